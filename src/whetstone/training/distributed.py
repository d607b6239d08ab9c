"""Scale-out of training under `torchrun`: the process group (gloo on CPU, NCCL on GPU: each
rank on the GPU of its LOCAL_RANK), FSDP2 sharding, collectives, and whole-state gathers for
publishing, exporting and checkpoints. Mid-training and the RL trainer both use it.

FSDP2 shards parameters, gradients and AdamW moments: one group per transformer block, and the
root (embeddings, tied head, final norm). Each rank's loss is its share of the whole step's
mean, so gradients are *summed* across ranks, never averaged. Rank 0 alone writes files; for that
it gathers the whole state (`full_state_dict`, `save_sharded_checkpoint`). Checkpoints keep the
unsharded format of a one-process run, so a run resumes on any number of ranks.

Outside torchrun (or with WORLD_SIZE 1) every function here is a no-op or the plain thing.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
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
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard

from whetstone.errors import ConfigError, WhetstoneError
from whetstone.model import Transformer
from whetstone.training.checkpoint import (
    TrainState,
    checkpoint_dir,
    implementation,
    load_checkpoint,
    naming_older_checkpoints,
    save_checkpoint,
)
from whetstone.training.readback import read_back
from whetstone.utils.device import resolve_device

COLLECTIVE_TIMEOUT = timedelta(hours=1)
"""How long a rank waits in a collective before the job is torn down. Mid-training's first ones
wait for the corpus to be built, which a large corpus can take longer than NCCL's default 10
minutes to do."""

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
    """Where this rank's collectives run: its own GPU under NCCL, else the CPU."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


@contextmanager
def torchrun_group(device: str = "auto") -> Iterator[tuple[int, int]]:
    """Join the job torchrun describes in the environment (WORLD_SIZE, RANK, LOCAL_RANK,
    MASTER_ADDR/PORT) for the duration of the block; yields (rank, world size). Without torchrun,
    with one rank, or inside a group someone else made, it only reports where it is.

    `device` is the trainer's config value: on CUDA (`auto` with a GPU, or `cuda`) each rank
    takes the GPU of its LOCAL_RANK and the group runs over NCCL; on the CPU, over gloo."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1 or dist.is_initialized():
        yield world()
        return
    if device.startswith("cuda:"):
        raise ConfigError(
            f"device = {device!r} under torchrun: every rank takes the GPU of its LOCAL_RANK; "
            "set device to 'cuda' or 'auto'"
        )
    on_cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    gpu = None
    if on_cuda:
        resolve_device("cuda")  # a clear error on a machine without CUDA
        gpu = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(gpu)
    # the group bound to the rank's GPU: NCCL's barrier otherwise picks RANK % the GPUs it sees,
    # not the current device, which on several machines with fewer ranks than GPUs each is
    # another GPU (and another communicator, which the other ranks never join)
    dist.init_process_group("nccl" if on_cuda else "gloo", timeout=COLLECTIVE_TIMEOUT, device_id=gpu)
    try:
        yield world()
        # every rank is done before any tears the group down: a rank that destroys it while
        # another is still in its last collective can abort ("terminate called" under gloo)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def shard_model(model: Transformer, device: torch.device, frozen: bool = False) -> Transformer:
    """The model on `device`; under torchrun, FSDP2 over all ranks (in place) on a mesh of that
    device type: each block one group, then the root. `frozen`: a model that only runs forwards
    (a reference), whose root is resharded after each one; FSDP2 otherwise keeps the root
    (embeddings, head, final norm) whole until a backward, which such a model never runs."""
    model.to(device)
    if world()[1] == 1:
        return model
    mesh = init_device_mesh(device.type, (world()[1],))
    for block in model.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh, reshard_after_forward=True if frozen else None)
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


def sum_over_ranks(values: list[float | torch.Tensor]) -> list[float]:
    """Each value (a number or a 0-d tensor) summed over all ranks, read back as floats (float64,
    so counts up to 2^53 stay exact); as is on one rank."""
    if world()[1] == 1:
        return list(read_back({str(i): value for i, value in enumerate(values)}).values())
    here = device()
    sums = torch.stack([torch.as_tensor(value, dtype=torch.float64, device=here).reshape(()) for value in values])
    dist.all_reduce(sums)
    return sums.tolist()


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
    """`training.checkpoint.save_checkpoint`, from shards: every rank gathers, rank 0 writes (on
    one rank, the plain save).

    Rank 0 fills a plain (unsharded) copy of the model and optimizer and saves that, so the
    checkpoint is the same files a one-process run writes, and resumes on any number of ranks.
    """
    if world()[1] == 1:
        save_checkpoint(root, model, optimizer, state, config, keep)
        return
    weights = get_model_state_dict(model, options=GATHER)
    moments = get_optimizer_state_dict(model, optimizer, options=GATHER)

    def write() -> None:
        plain, plain_optimizer = _plain_copy(model, new_optimizer)
        plain.load_state_dict(weights)
        plain_optimizer.load_state_dict(_indexed(moments))
        save_checkpoint(root, plain, plain_optimizer, state, config, keep)

    on_rank_0(write, f"write checkpoint {checkpoint_dir(root, state.step)}")


def load_sharded_checkpoint(
    path: Path | None, model: Transformer, optimizer: torch.optim.Optimizer, new_optimizer: NewOptimizer
) -> TrainState:
    """`training.checkpoint.load_checkpoint` into shards: rank 0 reads `path` (given on rank 0
    only) into a plain copy and every rank takes its shard of it (on one rank, the plain load).
    Returns the loop's state on every rank. A damaged checkpoint is refused on every rank with
    the older complete ones named (`naming_older_checkpoints`, looked for by rank 0)."""
    if world()[1] == 1:
        with naming_older_checkpoints(path):
            return load_checkpoint(path, model, optimizer)
    weights: dict[str, Any] = {}
    moments: dict[str, Any] = {}

    def read() -> TrainState:
        nonlocal weights, moments
        plain, plain_optimizer = _plain_copy(model, new_optimizer)
        with naming_older_checkpoints(path):  # rank 0 names them: the other ranks raise its message
            state = load_checkpoint(path, plain, plain_optimizer)
        weights, moments = plain.state_dict(), _named(plain, plain_optimizer)
        # every rank takes these groups whole: with the plain CPU copy's implementation, a CUDA
        # optimizer would lose its fused AdamW (and its step counts would stay on the host)
        for group, own in zip(moments["param_groups"], optimizer.param_groups):
            group.update(implementation(own))
        return state

    state = on_rank_0(read, f"read checkpoint {path}")
    set_model_state_dict(model, weights, options=SCATTER)
    set_optimizer_state_dict(model, optimizer, moments, options=SCATTER)
    return broadcast(state)


def on_rank_0(work: Callable[[], T], what: str) -> T | None:
    """`work()` on rank 0 alone (its value there, None on the other ranks), its failure raised on
    every rank. Every rank must call it: rank 0 broadcasts the outcome. Otherwise the other ranks
    would go on into the next collective, which rank 0 never joins, and wait there until the
    group's timeout (`COLLECTIVE_TIMEOUT`) or until torchrun ends them, none of them saying why.

    A `WhetstoneError` is raised on the other ranks as it is on rank 0 (its class and message: a
    `DamagedCheckpoint` still names the older checkpoints); any other exception as a
    `WhetstoneError` naming `what` rank 0 could not do, and the error."""
    value, failure = None, None
    if world()[0] == 0:
        try:
            value = work()
        except Exception as err:
            if isinstance(err, WhetstoneError):
                failure = (type(err), str(err))
            else:
                failure = (WhetstoneError, f"rank 0 could not {what}: {type(err).__name__}: {err}")
            broadcast(failure)
            raise
    failure = broadcast(failure)
    if failure is not None:
        kind, message = failure
        try:
            error = kind(message)
        except Exception:  # a class that takes more than a message
            error = WhetstoneError(message)
        raise error
    return value


def _plain_copy(model: Transformer, new_optimizer: NewOptimizer) -> tuple[Transformer, torch.optim.Optimizer]:
    """An unsharded CPU model of the same shape and its optimizer (values to be overwritten)."""
    plain = _plain_model(model)
    return plain, new_optimizer(plain)


def _plain_model(model: Transformer) -> Transformer:
    """An unsharded CPU model of `model`'s shape; its values are overwritten next, so its random
    init runs on a forked RNG (the run's own RNG state stays as the checkpoint records it)."""
    with torch.random.fork_rng(devices=[]):
        return Transformer(model.cfg)


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


def barrier() -> None:
    """Wait until every rank is here (nothing outside a process group)."""
    if world()[1] > 1:
        dist.barrier()


def sum_on_device(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` summed over all ranks, in place, where it is (a collective the device queues: no
    read-back); itself on one rank."""
    if world()[1] > 1:
        dist.all_reduce(tensor)
    return tensor


def gathered_model(model: Transformer) -> Transformer | None:
    """The whole model as a plain (unsharded) CPU copy on rank 0, None on the other ranks; the
    model itself outside a process group. Every rank must call it (it gathers the shards)."""
    if world()[1] == 1:
        return model
    weights = full_state_dict(model)
    if weights is None:
        return None
    plain = _plain_model(model)
    plain.load_state_dict(weights)
    return plain
