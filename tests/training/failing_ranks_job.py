"""A 2-rank job for test_distributed.py (run under torchrun, gloo): what rank 0 alone reads or
writes of a checkpoint fails there, and every rank must learn it before its next collective.

Rank 0 writes a checkpoint into a folder that cannot be made (a file is in its place), then
reads a checkpoint whose model.safetensors was damaged after it was written. Each rank records
what each of the two raised in rank-N.json in the folder given, then ends with the others."""

import json
import sys
from pathlib import Path

import torch
from ranks_job import CFG, CPU, new_optimizer  # a sibling script: torchrun puts its folder on sys.path

from whetstone.model import Transformer
from whetstone.training.checkpoint import MODEL_FILE, TrainState
from whetstone.training.distributed import (
    barrier,
    load_sharded_checkpoint,
    save_sharded_checkpoint,
    shard_model,
    torchrun_group,
    world,
)
from whetstone.utils.processes import exit_process


def raised(work) -> str | None:
    """What `work()` raised, as `Type: message`, or None."""
    try:
        work()
    except Exception as err:
        return f"{type(err).__name__}: {err}"
    return None


def main(root: Path) -> None:
    with torchrun_group("cpu"):
        rank, _ = world()
        torch.manual_seed(0)
        model = shard_model(Transformer(CFG), CPU)
        optimizer = new_optimizer(model)
        checkpoints = root / "checkpoints"
        save_sharded_checkpoint(checkpoints, model, optimizer, new_optimizer, TrainState(step=1), {}, keep=2)

        blocked = root / "blocked"  # a file where the checkpoints folder would go
        if rank == 0:
            blocked.write_text("not a folder\n")
        barrier()
        save = raised(
            lambda: save_sharded_checkpoint(blocked, model, optimizer, new_optimizer, TrainState(step=2), {}, keep=2)
        )

        path = checkpoints / "step_00000001"
        if rank == 0:
            with open(path / MODEL_FILE, "r+b") as handle:  # one byte flipped: the sha256 no longer matches
                handle.seek(-1, 2)
                last = handle.read(1)
                handle.seek(-1, 2)
                handle.write(bytes([last[0] ^ 0xFF]))
        barrier()
        resumed = shard_model(Transformer(CFG), CPU)
        load = raised(
            lambda: load_sharded_checkpoint(path if rank == 0 else None, resumed, new_optimizer(resumed), new_optimizer)
        )
        (root / f"rank-{rank}.json").write_text(json.dumps({"rank": rank, "save": save, "load": load}))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
    exit_process(0)  # as the whetstone command's ranks end
