"""Mid-training: next-token training of the model on the code corpus, before RL (docs/midtrain.md).

    from whetstone.midtrain.cli import run_midtrain       # the run as a function
    from whetstone.midtrain.config import MidtrainConfig

Kept import-free so `whetstone --help` does not load torch.
"""
