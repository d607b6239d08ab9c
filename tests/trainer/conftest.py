from __future__ import annotations

import pytest
import torch

from tests.trainer.trainer_fixtures import make_batches, save_chat_moe, save_tiny_moe


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)  # the cores are shared with other engineers' tests


@pytest.fixture(scope="session")
def tiny_moe(tmp_path_factory):
    """An HF folder of a tiny random MoE (what mid-training would export)."""
    return save_tiny_moe(tmp_path_factory.mktemp("model") / "model")


@pytest.fixture(scope="session")
def batches(tiny_moe):
    """Seven batches sampled from the tiny MoE by the inference engine."""
    torch.set_num_threads(1)
    return make_batches(tiny_moe, 7)


@pytest.fixture(scope="session")
def chat_moe(tmp_path_factory):
    """The tiny MoE with a chat tokenizer in its folder (for demonstrations: `rl.demos`)."""
    return save_chat_moe(tmp_path_factory.mktemp("chat_moe") / "model", tmp_path_factory.mktemp("tokenizer"))
