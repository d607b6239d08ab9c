"""whetstone: turn a general open model into a specialist coding agent."""

import os
import sys

# Roles share cores (trainer, servers, orchestrator on one machine): OpenMP's default
# spin-waiting made 2-thread training ~5x slower whenever another process was busy, so they wait
# passively. A command whose own process computes with the cores to itself keeps OpenMP's default
# (spin briefly, then sleep): passive waiting costs it a wake-up in every parallel region, and
# mid-training's bf16 step took 110-125 ms instead of 58-62 (fp32: 115-135 against 81-92). It must
# be set before torch loads its OpenMP runtime, hence here, before anything imports torch.
COMPUTES_ALONE = (("midtrain",), ("run",), ("bench", "train"), ("bench", "pipeline"))
"""Commands whose process has the cores to itself while it computes (`whetstone run`'s own process
mid-trains before any role starts; the pipeline benchmark runs TRL in its own process, alone)."""
if not any(tuple(sys.argv[1 : 1 + len(command)]) == command for command in COMPUTES_ALONE):
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

__version__ = "0.1.0"


def main() -> None:
    """The `whetstone` command (`whetstone.cli.main`). Its modules, torch among them, take a second
    or more to load; they load here, so that a Ctrl-C meanwhile ends as one during a command does:
    one line, "stopped by SIGINT", and exit code 130, not a traceback."""
    try:
        from whetstone.cli import main as command
    except KeyboardInterrupt:
        sys.stderr.write("stopped by SIGINT\n")
        raise SystemExit(130) from None
    command()
