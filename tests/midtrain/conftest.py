"""A tiny real corpus (stdlib modules copied into a temp folder) and a tiny MoE config that
trains on it in a second or two. The corpus cache is shared by the whole session."""

from __future__ import annotations

import bisect
import fnmatch
import heapq
import inspect
import json.decoder
import shlex
import string
import textwrap
from pathlib import Path

import pytest
import torch

from whetstone.config import load_config
from whetstone.midtrain.config import MidtrainConfig

MODULES = [bisect, fnmatch, heapq, json.decoder, shlex, string, textwrap]

TINY = [
    "data.stdlib=false",
    "data.vocab_size=320",
    "data.validation_fraction=0.3",
    "data.seq_len=32",
    "model.vocab_size=320",
    "model.hidden_size=32",
    "model.num_hidden_layers=2",
    "model.num_attention_heads=2",
    "model.num_key_value_heads=1",
    "model.head_dim=16",
    "model.num_experts=4",
    "model.num_experts_per_tok=2",
    "model.moe_intermediate_size=32",
    "run.threads=1",
    "run.steps=8",
    "run.batch_size=4",
    "run.eval_interval=4",
    "run.eval_batches=2",
    "run.checkpoint_interval=4",
    "optimizer.warmup_steps=2",
    "optimizer.lr=0.01",
]


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)  # the cores are shared with other engineers' tests


@pytest.fixture(scope="session")
def corpus_dirs(tmp_path_factory) -> tuple[Path, Path]:
    """(code folder, corpus cache folder), made once per session."""
    root = tmp_path_factory.mktemp("midtrain-corpus")
    for module in MODULES:
        path = root / "code" / (module.__name__.replace(".", "_") + ".py")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(inspect.getsource(module))
    return root / "code", root / "cache"


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
