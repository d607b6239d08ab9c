"""What every trainer shares: the optimizer and its config, the learning-rate schedule,
checkpoints, and scale-out under torchrun. Used by mid-training, the RL trainer, the online loop
and the benchmarks.

    from whetstone.training.config import OptimizerConfig
    from whetstone.training.optim import optimizer_for, clip_gradients, optimizer_step
    from whetstone.training.readback import read_back
    from whetstone.training.schedule import lr_at
    from whetstone.training.checkpoint import save_checkpoint, load_checkpoint, latest_checkpoint
    from whetstone.training.distributed import torchrun_group, shard_model  # torchrun, FSDP2

Kept import-free so `whetstone --help` does not load torch.
"""
