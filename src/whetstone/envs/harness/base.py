"""The harness seam: anything that can work on a task in a sandbox with a policy and say what it
sampled. The built-in one is `AgentHarness` (loop.py); a user's own harness subclasses this.

A harness must fill `segments` (token ids exactly as the policy returned them, with loss masks),
`turns` and `invalid_tool_calls`, and may add `timings`; `rollout()` opens and closes the
sandbox, grades the workspace afterwards and records the reward, so a harness never grades.
It should stop by the task's `time_limit_s`: `rollout()` cancels it a little after that. A
harness that cannot go on returns its trajectory with `status="failed"` and the reason in
`error` (or raises; the rollout is then recorded as failed without its segments).
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from whetstone.envs.harness.policy import Policy
from whetstone.envs.sandbox import Sandbox
from whetstone.envs.task import Task
from whetstone.envs.trajectory import Trajectory


class Harness(ABC):
    context_tokens: int = 0
    """Context window (prompt + completion) a rollout needs from its server; 0 = whatever the
    server's limit is. A `ServerPool` leases a rollout only to a server that holds it."""

    @abstractmethod
    async def run(self, task: Task, policy: Policy, sandbox: Sandbox) -> Trajectory:
        """Work on `task` in `sandbox` (already set up) until done or out of budget."""
