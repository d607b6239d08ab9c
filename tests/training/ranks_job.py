"""A 2-rank job for test_distributed.py (run under torchrun, gloo): a sharded resume keeps the
optimizer's own implementation, a frozen model's root is resharded after each forward, and the
trainer's step figures over the ranks are those of their rows together. Each rank writes what
it saw to rank-N.json in the folder given."""

import json
import sys
from pathlib import Path

import torch
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from whetstone.model import ModelConfig, Transformer
from whetstone.rl.loss import diff_summary
from whetstone.trainer.distributed import reduce_step_stats
from whetstone.training.checkpoint import TrainState
from whetstone.training.distributed import (
    load_sharded_checkpoint,
    save_sharded_checkpoint,
    shard_model,
    torchrun_group,
    world,
)
from whetstone.utils.processes import exit_process

CFG = ModelConfig(
    vocab_size=64,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=16,
    num_experts=4,
    moe_intermediate_size=16,
)
CPU = torch.device("cpu")


def new_optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    """Fused AdamW for the sharded model, as on CUDA; torch's default for the plain copy rank 0
    reads the checkpoint into, as whetstone's own `new_optimizer` gives on the CPU."""
    fused = True if isinstance(model, FSDPModule) else None
    return torch.optim.AdamW(model.parameters(), lr=1e-3, fused=fused)


def main(root: Path) -> None:
    with torchrun_group("cpu"):
        rank, _ = world()
        torch.manual_seed(0)
        model = shard_model(Transformer(CFG), CPU)
        optimizer = new_optimizer(model)
        ids = torch.randint(0, CFG.vocab_size, (2, 8))
        (-model(ids, targets=ids).logprobs.sum()).backward()
        optimizer.step()
        save_sharded_checkpoint(root, model, optimizer, new_optimizer, TrainState(step=1), {}, keep=2)

        resumed = shard_model(Transformer(CFG), CPU)
        resumed_optimizer = new_optimizer(resumed)
        path = root / "step_00000001" if rank == 0 else None
        load_sharded_checkpoint(path, resumed, resumed_optimizer, new_optimizer)
        (-resumed(ids, targets=ids).logprobs.sum()).backward()
        resumed_optimizer.step()  # the fused step runs on what the resume gave it

        frozen = shard_model(Transformer(CFG).eval().requires_grad_(False), CPU, frozen=True)
        with torch.no_grad():
            frozen(ids, targets=ids)

        # |delta| of both ranks' positions (NaN where untrained; rank 1 has fewer, and ties),
        # summarised over the ranks and over the two together in one process
        generator = torch.Generator().manual_seed(5)
        diffs = [torch.rand(6, 50, generator=generator).square() * 2 for _ in range(2)]
        diffs[1] = diffs[1][:2].round(decimals=1)
        for diff in diffs:
            diff[diff < 0.3] = float("nan")
        step = reduce_step_stats({"loss": torch.tensor(float(rank + 1))}, diffs[rank], {"grad_norm": 3.0})
        whole = {name: float(value) for name, value in diff_summary(torch.cat([d.flatten() for d in diffs])).items()}
        (root / f"rank-{rank}.json").write_text(
            json.dumps(
                {
                    "rank": rank,
                    "fused": [group["fused"] for group in resumed_optimizer.param_groups],
                    "frozen_whole_after_forward": sorted(
                        name for name, p in frozen.named_parameters() if not isinstance(p, DTensor)
                    ),
                    "step": step,
                    "whole": whole,
                }
            )
        )


if __name__ == "__main__":
    main(Path(sys.argv[1]))
    exit_process(0)  # as the whetstone command's ranks end
