"""A tiny real corpus (stdlib modules copied into a temp folder) and a tiny MoE config that
trains on it in a second or two. The corpus cache is shared by the whole session."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.midtrain.midtrain_support import TINY, write_corpus
from whetstone.config import load_config
from whetstone.midtrain.config import MidtrainConfig


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)  # the cores are shared with other engineers' tests


@pytest.fixture(scope="session")
def corpus_dirs(tmp_path_factory) -> tuple[Path, Path]:
    """(code folder, corpus cache folder), made once per session."""
    root = tmp_path_factory.mktemp("midtrain-corpus")
    return write_corpus(root), root / "cache"


@pytest.fixture
def make_config(corpus_dirs, tmp_path):
    """`make_config("run.steps=4", ...)` -> the tiny config writing under this test's tmp_path."""
    code_dir, cache_dir = corpus_dirs

    def make(*overrides: str) -> MidtrainConfig:
        paths = [
            f'data.directories=[{{path="{code_dir}"}}]',
            f'data.cache_dir="{cache_dir}"',
            f'run.output_dir="{tmp_path / "runs"}"',
        ]
        return load_config(MidtrainConfig, None, [*TINY, *paths, *overrides])

    return make
