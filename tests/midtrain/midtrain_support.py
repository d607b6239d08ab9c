"""The tiny real corpus and tiny MoE mid-training config shared by tests that mid-train."""

import bisect
import fnmatch
import heapq
import inspect
import json.decoder
import shlex
import string
import textwrap
from pathlib import Path

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


def write_corpus(root: Path) -> Path:
    """Source files of a few stdlib modules under root/code (a real, tiny code corpus)."""
    for module in MODULES:
        path = root / "code" / (module.__name__.replace(".", "_") + ".py")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(inspect.getsource(module))
    return root / "code"
