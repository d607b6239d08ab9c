"""Sandboxes: isolated, limited command execution over a private copy of a task's files.

    with open_sandbox({"main.py": "print(1)"}) as sandbox:
        result = sandbox.run("python main.py")

See docs/sandbox.md for what is isolated, how each limit is enforced, and the measured speed.
"""

from whetstone.envs.sandbox.bwrap import Mount, SandboxUnavailableError
from whetstone.envs.sandbox.config import SandboxConfig
from whetstone.envs.sandbox.process import RunResult
from whetstone.envs.sandbox.sandbox import Sandbox, open_sandbox

__all__ = ["Mount", "RunResult", "Sandbox", "SandboxConfig", "SandboxUnavailableError", "open_sandbox"]
