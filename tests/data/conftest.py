"""A small real code tree (stdlib modules copied into a temp folder) and a config that builds it fast."""

from __future__ import annotations

import bisect
import colorsys
import fnmatch
import glob
import heapq
import inspect
import json.decoder
import json.encoder
import numbers
import queue
import sched
import shlex
import string
import textwrap
from pathlib import Path

import pytest

from whetstone.data import CorpusConfig, DirectorySource

MODULES = [
    bisect,
    colorsys,
    fnmatch,
    glob,
    heapq,
    json.decoder,
    json.encoder,
    numbers,
    queue,
    sched,
    shlex,
    string,
    textwrap,
]


def write_code_tree(root: Path) -> Path:
    for module in MODULES:
        path = root / "pkg" / (module.__name__.replace(".", "_") + ".py")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(inspect.getsource(module))
    return root


def tiny_config(code_dir: Path, cache_dir: Path, **overrides) -> CorpusConfig:
    settings = dict(
        stdlib=False,
        directories=[DirectorySource(path=str(code_dir))],
        vocab_size=400,
        validation_fraction=0.2,
        cache_dir=str(cache_dir),
        seq_len=32,
    )
    return CorpusConfig(**{**settings, **overrides})


@pytest.fixture
def code_dir(tmp_path) -> Path:
    return write_code_tree(tmp_path / "code")


@pytest.fixture
def config(code_dir, tmp_path) -> CorpusConfig:
    return tiny_config(code_dir, tmp_path / "cache")


@pytest.fixture(scope="session")
def make_config():
    """For module-scoped corpora: make_config(folder) writes the code tree there and configures it."""

    def make(root: Path, **overrides) -> CorpusConfig:
        return tiny_config(write_code_tree(root / "code"), root / "cache", **overrides)

    return make
