"""The agent harness: a multi-turn tool loop over a task in a sandbox, talking to a policy served
over HTTP, recording token-exact trajectories, summarizing itself when its context fills up,
and running many graded rollouts at once. See docs/harness.md.

    policy = await HttpPolicy.connect(EndpointConfig(base_url="http://127.0.0.1:8000/v1"))
    harness = AgentHarness.from_config(HarnessConfig(tokenizer_path="runs/model"))
    trajectories = await run_rollouts(tasks, policy, harness, RolloutConfig(), samples=4)
"""

from whetstone.envs.harness.base import Harness
from whetstone.envs.harness.config import EndpointConfig, HarnessConfig, RolloutConfig, SamplingConfig
from whetstone.envs.harness.loop import AgentHarness
from whetstone.envs.harness.policy import Completion, HttpPolicy, Policy, PolicyError, Sampling
from whetstone.envs.harness.pool import PooledPolicy, ServerPool
from whetstone.envs.harness.rollout import rollout, run_rollouts

__all__ = [
    "AgentHarness",
    "Completion",
    "EndpointConfig",
    "Harness",
    "HarnessConfig",
    "HttpPolicy",
    "Policy",
    "PolicyError",
    "PooledPolicy",
    "RolloutConfig",
    "Sampling",
    "SamplingConfig",
    "ServerPool",
    "rollout",
    "run_rollouts",
]
