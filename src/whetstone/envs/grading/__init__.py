"""Grading: a rollout's changes tested on the pristine repository, cheat checks, the judge and the
reward (docs/sandbox.md).

    from whetstone.envs.grading.grade import grade, workspace_changes
    from whetstone.envs.grading.reward import Effort, RewardConfig

`in_sandbox/` holds the two files that run inside the grading sandbox: stdlib only, they import
nothing from whetstone.
"""
