"""The marker of tests that need two GPUs (FSDP2 over NCCL takes one per rank; a role on a second
GPU): skipped below two, as the `gpu` marker skips them where there is none."""

import pytest
import torch

TWO_GPUS = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
