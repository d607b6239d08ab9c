"""whetstone: turn a general open model into a specialist coding agent."""

import os

# Roles share cores (trainer, servers, orchestrator on one machine): OpenMP's default
# spin-waiting made 2-thread training ~5x slower whenever another process was busy. It must be
# set before torch loads its OpenMP runtime, hence here, before anything imports torch.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

__version__ = "0.1.0"
