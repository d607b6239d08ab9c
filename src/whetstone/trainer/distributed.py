"""The RL trainer's side of scale-out under `torchrun` (the rest is `training.distributed`):

    torchrun --standalone --nproc_per_node 2 -m whetstone.cli trainer CONFIG

Every rank reads the whole batch and trains on its rows (`rank_rows`); each rank's loss is its
share of the whole step's loss mean (`global_normalizer`), and the step's figures are the whole
step's on every rank (`reduce_step_stats`). Rank 0 alone publishes.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist

from whetstone.rl.batch import Batch
from whetstone.rl.loss import DIFF_SUMMARY, step_normalizer
from whetstone.training.distributed import device, sum_over_ranks, world
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


def global_normalizer(shard: Batch, aggregation: str) -> float:
    """N of the whole step's loss: the sum of every rank's shard (padding rows add nothing)."""
    (count,) = sum_over_ranks([step_normalizer(shard.loss_mask, aggregation, shard.rollout_shares)])
    return float(count)


def reduce_step_stats(
    totals: dict[str, Any], abs_diff: torch.Tensor, whole: dict[str, Any] | None = None
) -> dict[str, float]:
    """A step's figures read back to the host with one transfer: `totals`, this rank's shares
    (losses, counts and the |Δ| summary: `LossStats.totals`, `RoutingStats.totals`), and `whole`,
    figures every rank already holds whole (the gradient norm). Under torchrun, the whole step's
    on every rank: the ranks' shares summed (losses are shares of one mean), and the |Δ| summary
    over every rank's |Δ| (`abs_diff`, NaN where untrained): its mean and count over ln 2 from
    sums, its p99 and max (as `rl.loss.diff_summary` takes them) from the ranks' largest 1%."""
    whole = whole or {}
    if world()[1] == 1:
        return read_back({**totals, **whole})
    summed = [name for name in totals if name not in DIFF_SUMMARY]
    diff = abs_diff.detach().flatten().double()
    trained = ~diff.isnan()
    mine = [diff.nansum(), trained.sum(), (diff > math.log(2)).sum()]
    *shares, diff_total, count, over = sum_over_ranks([totals[name] for name in summed] + mine)
    sums = dict(zip(summed, shares))
    if not count:
        return {**sums, **dict.fromkeys(DIFF_SUMMARY, 0.0), **read_back(whole)}
    # p99 and max need only the largest values of all: from the p99's lower neighbour up, which
    # are among each rank's own largest that many (all |Δ| >= 0; -inf pads a rank with fewer)
    count = int(count)
    position = (count - 1) * 0.99  # as `nan_quantiles` places the p99
    low = math.floor(position)
    keep = count - low
    largest = diff.nan_to_num(nan=-math.inf).topk(min(keep, diff.numel())).values
    mine_top = torch.cat((largest, largest.new_full((keep - largest.numel(),), -math.inf))).to(device())
    tops = [torch.empty_like(mine_top) for _ in range(world()[1])]
    dist.all_gather(tops, mine_top)
    ascending = torch.cat(tops).sort(descending=True).values[:keep].flip(0)  # ranks low..count-1 of all
    p99 = torch.lerp(ascending[0], ascending[math.ceil(position) - low], position - low)
    summary = {"diff_mean": diff_total / count, "diff_p99": p99, "diff_max": ascending[-1], "diff_over_ln2": over}
    return {**sums, **read_back({**summary, **whole})}
