"""The RL trainer (docs/trainer.md): batch n → optimizer step n → weight version n + 1.

    from whetstone.trainer.config import TrainerConfig
    from whetstone.trainer.loop import run_trainer          # the process as a function
    from whetstone.trainer.step import train_step           # one step over a batch

Under `torchrun` the same process runs on every rank, sharded with FSDP2 (training.distributed).

Kept import-free so `whetstone --help` does not load torch.
"""
