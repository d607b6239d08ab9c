"""Fixtures: a checkpoint folder laid out exactly like Qwen3's tokenizer files, made here.

Nothing can be downloaded, so the vocabulary is a small BPE trained on a stdlib module; the rest
(normalizer, split regex, byte-level steps, the 26 added tokens after the vocabulary in Qwen3's
order and flags, tokenizer_config.json with Qwen3-8B's chat template) follows Qwen3's files.
"""

from __future__ import annotations

import inspect
import json
import textwrap
from pathlib import Path

import pytest
from tokenizers import Tokenizer as Backend
from tokenizers import models, pre_tokenizers, trainers

QWEN3_TEMPLATE = (Path(__file__).parent / "qwen3_chat_template.jinja").read_text().rstrip("\n")
QWEN3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# (content, special) in Qwen3's id order, starting right after the BPE vocabulary (151643 there).
QWEN3_ADDED = [
    ("<|endoftext|>", True),
    ("<|im_start|>", True),
    ("<|im_end|>", True),
    ("<|object_ref_start|>", True),
    ("<|object_ref_end|>", True),
    ("<|box_start|>", True),
    ("<|box_end|>", True),
    ("<|quad_start|>", True),
    ("<|quad_end|>", True),
    ("<|vision_start|>", True),
    ("<|vision_end|>", True),
    ("<|vision_pad|>", True),
    ("<|image_pad|>", True),
    ("<|video_pad|>", True),
    ("<tool_call>", False),
    ("</tool_call>", False),
    ("<|fim_prefix|>", False),
    ("<|fim_middle|>", False),
    ("<|fim_suffix|>", False),
    ("<|fim_pad|>", False),
    ("<|repo_name|>", False),
    ("<|file_sep|>", False),
    ("<tool_response>", False),
    ("</tool_response>", False),
    ("<think>", False),
    ("</think>", False),
]
BYTE_LEVEL = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}


def _vocab_and_merges() -> tuple[dict[str, int], list[str]]:
    backend = Backend(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=600, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    backend.train_from_iterator([inspect.getsource(textwrap)], trainer)
    model = json.loads(backend.to_str())["model"]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]  # Qwen3 stores "a b"
    return model["vocab"], merges


def write_qwen3_checkpoint(directory: Path) -> Path:
    vocab, merges = _vocab_and_merges()
    first = len(vocab)
    added = [
        {
            "id": first + i,
            "content": content,
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": special,
        }
        for i, (content, special) in enumerate(QWEN3_ADDED)
    ]
    tokenizer_json = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": {"type": "NFC"},
        "pre_tokenizer": {
            "type": "Sequence",
            "pretokenizers": [
                {"type": "Split", "pattern": {"Regex": QWEN3_SPLIT}, "behavior": "Isolated", "invert": False},
                BYTE_LEVEL,
            ],
        },
        "post_processor": BYTE_LEVEL,
        "decoder": BYTE_LEVEL,
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": "",
            "end_of_word_suffix": "",
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": False,
            "vocab": vocab,
            "merges": merges,
        },
    }
    tokenizer_config = {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": {
            str(token["id"]): {key: value for key, value in token.items() if key != "id"} for token in added
        },
        "additional_special_tokens": [content for content, special in QWEN3_ADDED[1:14]],
        "bos_token": None,
        "chat_template": QWEN3_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": 131072,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "tokenizer.json").write_text(json.dumps(tokenizer_json, indent=2, ensure_ascii=False))
    (directory / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=4))
    return directory


@pytest.fixture(scope="session")
def qwen3_dir(tmp_path_factory) -> Path:
    return write_qwen3_checkpoint(tmp_path_factory.mktemp("qwen3") / "checkpoint")


@pytest.fixture(scope="session")
def qwen3_hf(qwen3_dir):
    """transformers' own tokenizer for the same folder: the reference we compare against."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(qwen3_dir))
