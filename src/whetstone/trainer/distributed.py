"""Scale-out of the trainer: `torchrun` ranks, FSDP2 sharding (gloo on CPU, NCCL on GPU).

    torchrun --standalone --nproc_per_node 2 -m whetstone.cli trainer CONFIG

Every rank reads the whole batch and trains on its rows (`rank_rows`); each rank's loss is its
share of the whole step's loss mean (`global_normalizer`), so the gradients are *summed*
across ranks, never averaged. FSDP2 shards parameters, gradients and AdamW moments: one group
per transformer block, and the root (embeddings, tied head, final norm). Rank 0 alone publishes,
writes metrics and checkpoints; for that it gathers the whole state (`full_state_dict`,
`save_sharded_checkpoint`). Checkpoints keep midtrain's unsharded format, so a run resumes on
any number of ranks.

Outside torchrun (or with WORLD_SIZE 1) every function here is a no-op or the plain thing.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.fsdp import FSDPModule, fully_shard

from whetstone.model import Transformer
from whetstone.rl.batch import OPTIONAL_FIELDS, TENSOR_FIELDS, Batch
from whetstone.rl.loss import LossStats, step_normalizer
from whetstone.rl.routing import RoutingStats
from whetstone.training.checkpoint import TrainState, load_checkpoint, save_checkpoint

T = TypeVar("T")
NewOptimizer = Callable[[torch.nn.Module], torch.optim.Optimizer]
GATHER = StateDictOptions(full_state_dict=True, cpu_offload=True)  # whole tensors, on rank 0's CPU only
SCATTER = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)  # rank 0's whole tensors to the shards


def world() -> tuple[int, int]:
    """(rank, world size) of this process: (0, 1) outside a process group."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def device() -> torch.device:
    """Where this rank computes: its own GPU under NCCL, else the CPU."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


@contextmanager
def torchrun_group() -> Iterator[tuple[int, int]]:
    """Join the job torchrun describes in the environment (WORLD_SIZE, RANK, LOCAL_RANK,
    MASTER_ADDR/PORT) for the duration of the block; yields (rank, world size). Without torchrun,
    with one rank, or inside a group someone else made, it only reports where it is."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1 or dist.is_initialized():
        yield world()
        return
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend)
    try:
        yield world()
    finally:
        dist.destroy_process_group()


def shard_model(model: Transformer) -> Transformer:
    """FSDP2 over all ranks (in place): each block one group, then the root. A no-op on one rank."""
    if world()[1] == 1:
        return model
    model.to(device())
    for block in model.layers:
        fully_shard(block)
    fully_shard(model)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            # Sum the ranks' gradients: each rank's loss is already divided by the whole step's
            # token count. (A plain SUM: gloo has no PREMUL_SUM, which a divide factor would use.)
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)
    # The root returns `logprobs` as a view; the loss never modifies it in place, which is all
    # FSDP's warning is about.
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
    return model


def rank_rows(batch: Batch, rank: int, world: int) -> Batch:
    """Rows rank, rank + world, ... of `batch`, padded with untrained rows to ceil(rows / world).

    Every rank thus runs the same number of micro-batches (FSDP's collectives must pair up one
    for one), and a padding row (a copy of row 0 with its loss mask off) adds nothing to the
    loss, the gradient or the metrics. The rows' tensors are on this rank's device.
    """
    own = list(range(rank, len(batch), world))
    per_rank = -(-len(batch) // world)
    shard = batch.select(own + [0] * (per_rank - len(own)))
    shard.loss_mask[len(own) :] = False
    here = device()
    for name in (*TENSOR_FIELDS, *OPTIONAL_FIELDS) if here.type != "cpu" else ():
        if getattr(shard, name) is not None:
            setattr(shard, name, getattr(shard, name).to(here))
    return shard


def global_normalizer(shard: Batch, aggregation: str) -> int:
    """N of the whole step's loss: the sum of every rank's shard (padding rows add nothing)."""
    (count,) = sum_over_ranks([step_normalizer(shard.loss_mask, aggregation)])
    return int(count)


def sum_over_ranks(values: list[float]) -> list[float]:
    """Each value summed over all ranks (float64, so counts up to 2^53 stay exact); as is on one rank."""
    if world()[1] == 1:
        return list(values)
    sums = torch.tensor(values, dtype=torch.float64, device=device())
    dist.all_reduce(sums)
    return sums.tolist()


def reduce_step_stats(loss: float, stats: LossStats, routing: RoutingStats) -> tuple[float, LossStats, RoutingStats]:
    """The whole step's figures on every rank: the ranks' losses (shares of one mean) and counts
    summed, and every rank's |Δ| gathered (p99 and max need them all). Unchanged on one rank."""
    if world()[1] == 1:
        return loss, stats, routing
    sums = sum_over_ranks(
        [
            loss,
            stats.tokens,
            stats.clipped,
            stats.masked,
            stats.truncated,
            stats.forking_dropped,
            stats.mismatch_k3,
            stats.ref_k3,
            stats.entropy,
            stats.scale_gradient,
            routing.choices,
            routing.disagreed,
            routing.tokens,
            routing.tokens_disagreed,
        ]
    )
    diffs: list[Any] = [None] * world()[1]
    dist.all_gather_object(diffs, stats.abs_diff)
    (
        loss,
        tokens,
        clipped,
        masked,
        truncated,
        forking_dropped,
        mismatch_k3,
        ref_k3,
        entropy,
        scale_gradient,
        *route_counts,
    ) = sums
    stats = LossStats(
        tokens=int(tokens),
        clipped=int(clipped),
        masked=int(masked),
        truncated=int(truncated),
        forking_dropped=int(forking_dropped),
        mismatch_k3=mismatch_k3,
        ref_k3=ref_k3,
        entropy=entropy,
        scale_gradient=scale_gradient,
        abs_diff=torch.cat(diffs),
    )
    return loss, stats, RoutingStats(*(int(count) for count in route_counts))


def broadcast(value: T) -> T:
    """Rank 0's `value` on every rank (any picklable object)."""
    if world()[1] == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def full_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor] | None:
    """The whole model's weights (the names and values `model.state_dict()` has on one rank), on
    rank 0's CPU; None on the other ranks. Every rank must call it (it gathers the shards)."""
    if world()[1] == 1:
        return model.state_dict()
    state = get_model_state_dict(model, options=GATHER)
    return state if world()[0] == 0 else None


def save_sharded_checkpoint(
    root: Path,
    model: Transformer,
    optimizer: torch.optim.Optimizer,
    new_optimizer: NewOptimizer,
    state: TrainState,
    config: dict,
    keep: int,
) -> None:
    """midtrain's `save_checkpoint`, from shards: every rank gathers, rank 0 writes.

    Rank 0 fills a plain (unsharded) copy of the model and optimizer and saves that, so the
    checkpoint is the same files a one-process run writes, and resumes on any number of ranks.
    """
    weights = get_model_state_dict(model, options=GATHER)
    moments = get_optimizer_state_dict(model, optimizer, options=GATHER)
    if world()[0] != 0:
        return
    plain, plain_optimizer = _plain_copy(model, new_optimizer)
    plain.load_state_dict(weights)
    plain_optimizer.load_state_dict(_indexed(moments))
    save_checkpoint(root, plain, plain_optimizer, state, config, keep)


def load_sharded_checkpoint(
    path: Path | None, model: Transformer, optimizer: torch.optim.Optimizer, new_optimizer: NewOptimizer
) -> TrainState:
    """midtrain's `load_checkpoint` into shards: rank 0 reads `path` (given on rank 0 only) into a
    plain copy and every rank takes its shard of it. Returns the loop's state on every rank."""
    weights: dict[str, Any] = {}
    moments: dict[str, Any] = {}
    state = None
    if world()[0] == 0:
        plain, plain_optimizer = _plain_copy(model, new_optimizer)
        state = load_checkpoint(path, plain, plain_optimizer)
        weights, moments = plain.state_dict(), _named(plain, plain_optimizer)
    set_model_state_dict(model, weights, options=SCATTER)
    set_optimizer_state_dict(model, optimizer, moments, options=SCATTER)
    return broadcast(state)


def _plain_copy(model: Transformer, new_optimizer: NewOptimizer) -> tuple[Transformer, torch.optim.Optimizer]:
    """An unsharded CPU model of the same shape and its optimizer; the values are overwritten
    next, so its random init runs on a forked RNG (the checkpoint records the run's RNG state)."""
    with torch.random.fork_rng(devices=[]):
        plain = Transformer(model.cfg)
    return plain, new_optimizer(plain)


def _indexed(named: dict[str, Any]) -> dict[str, Any]:
    """A name-keyed optimizer state dict (torch.distributed.checkpoint's form) in torch's own
    index-keyed form: parameters numbered in group order."""
    index = {name: i for i, name in enumerate(name for group in named["param_groups"] for name in group["params"])}
    return {
        "state": {index[name]: value for name, value in named["state"].items()},
        "param_groups": [
            {**group, "params": [index[name] for name in group["params"]]} for group in named["param_groups"]
        ],
    }


def _named(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The inverse of `_indexed` for a plain model's optimizer."""
    name_of = {id(param): name for name, param in model.named_parameters()}
    names = [name_of[id(param)] for group in optimizer.param_groups for param in group["params"]]
    indexed = optimizer.state_dict()
    return {
        "state": {names[i]: value for i, value in indexed["state"].items()},
        "param_groups": [{**group, "params": [names[i] for i in group["params"]]} for group in indexed["param_groups"]],
    }
