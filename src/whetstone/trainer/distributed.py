"""The RL trainer's side of scale-out under `torchrun` (the rest is `training.distributed`):

    torchrun --standalone --nproc_per_node 2 -m whetstone.cli trainer CONFIG

Every rank reads the whole batch and trains on its rows (`rank_rows`); each rank's loss is its
share of the whole step's loss mean (`global_normalizer`), and the step's figures are the whole
step's on every rank (`reduce_step_stats`). Rank 0 alone publishes.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from whetstone.rl.batch import Batch
from whetstone.rl.loss import DIFF_SUMMARY, diff_summary, step_normalizer
from whetstone.training.distributed import sum_over_ranks, world
from whetstone.training.readback import read_back


def rank_rows(batch: Batch, rank: int, world: int) -> Batch:
    """Rows rank, rank + world, ... of `batch`, padded with untrained rows to ceil(rows / world).

    Every rank thus runs the same number of micro-batches (FSDP's collectives must pair up one
    for one), and a padding row (a copy of row 0 with its loss mask off) adds nothing to the
    loss, the gradient or the metrics. The step moves them to the model's device.
    """
    own = list(range(rank, len(batch), world))
    per_rank = -(-len(batch) // world)
    shard = batch.select(own + [0] * (per_rank - len(own)))
    shard.loss_mask[len(own) :] = False
    return shard


def global_normalizer(shard: Batch, aggregation: str) -> int:
    """N of the whole step's loss: the sum of every rank's shard (padding rows add nothing)."""
    (count,) = sum_over_ranks([step_normalizer(shard.loss_mask, aggregation)])
    return int(count)


def reduce_step_stats(
    totals: dict[str, Any], abs_diff: torch.Tensor, whole: dict[str, Any] | None = None
) -> dict[str, float]:
    """A step's figures read back to the host with one transfer: `totals`, this rank's shares
    (losses, counts and the |Δ| summary: `LossStats.totals`, `RoutingStats.totals`), and `whole`,
    figures every rank already holds whole (the gradient norm). Under torchrun, the whole step's
    on every rank: the ranks' shares summed (losses are shares of one mean), and the |Δ| summary
    taken over every rank's |Δ| (`abs_diff`: p99 and max need them all)."""
    whole = whole or {}
    if world()[1] == 1:
        return read_back({**totals, **whole})
    summed = [name for name in totals if name not in DIFF_SUMMARY]
    sums = dict(zip(summed, sum_over_ranks([totals[name] for name in summed])))
    diffs: list[Any] = [None] * world()[1]
    dist.all_gather_object(diffs, abs_diff.cpu())
    return {**sums, **read_back({**diff_summary(torch.cat(diffs)), **whole})}
