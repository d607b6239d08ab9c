"""Builders of hand-made trajectories for the RL core tests."""

from __future__ import annotations

import pytest
import torch

from whetstone.envs.trajectory import ModelCall, Segment, Trajectory
from whetstone.inference.protocol import encode_routes


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)  # the cores are shared with other engineers' tests


def call(prompt, completion, logprobs=None, versions=None, mask=None, routes=None, **extra) -> ModelCall:
    """A model call; logprobs default to -0.1, -0.2, ..., versions to 0, mask to all ones."""
    n = len(completion)
    return ModelCall(
        prompt_ids=list(prompt),
        completion_ids=list(completion),
        logprobs=logprobs if logprobs is not None else [-0.1 * (i + 1) for i in range(n)],
        versions=versions if versions is not None else [0] * n,
        loss_mask=mask if mask is not None else [1] * n,
        routes=None if routes is None else encode_routes(routes),
        **extra,
    )


def trajectory(*segments: list[ModelCall], reward=1.0, task_id="t", group_id="g", **extra) -> Trajectory:
    return Trajectory(
        task_id=task_id,
        group_id=group_id,
        reward=reward,
        segments=[Segment(calls=calls) for calls in segments],
        **extra,
    )


def fake_routes(tokens: int, layers: int = 2, top_k: int = 2, offset: int = 0) -> torch.Tensor:
    """Distinct, recognisable expert ids [tokens, layers, top_k] (ids < 8)."""
    return (torch.arange(tokens * layers * top_k).view(tokens, layers, top_k) + offset) % 8
