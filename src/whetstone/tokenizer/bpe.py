"""Byte-level BPE tokenizer in Qwen3's layout, trained here or loaded from a checkpoint folder.

A trained tokenizer uses the same normalizer, split regex, byte-level mapping and special-token
strings as Qwen3's `tokenizer.json`, so whetstone code never needs to know which one it holds:
the embedded default trains a 4096-token vocabulary on the code corpus, a real run loads the
checkpoint's own file.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Sequence
from functools import cached_property
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors, trainers
from tokenizers import Tokenizer as Backend

from whetstone.config import expand_path
from whetstone.errors import CheckpointError, WhetstoneError
from whetstone.tokenizer.template import CHAT_TEMPLATE
from whetstone.utils.atomic import atomic_write_json, atomic_write_text

# Qwen2/Qwen3's pre-tokenizer split: contractions, letters (with one leading non-letter), single
# digits, punctuation runs, newline runs, other whitespace.
SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

ENCODING_VERSION = 2
"""The version of how `Tokenizer` turns text into ids beyond what its files say (version 2: the
truncation and padding a tokenizer.json may hold are ignored, every text is encoded whole). It
changes whenever the same tokenizer files give other ids, so that what was encoded with them and
cached (a built corpus) is built again."""

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
CHAT_SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)
"""Control tokens: Qwen3 marks them special (skipped by `decode(skip_special_tokens=True)`)."""
MARKUP_TOKENS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>")
"""Single tokens that are not special in Qwen3 (they survive decoding as text)."""
NORMALIZER_SHRINK = {"NFC": 4, "NFKC": 4, "NFD": 1, "NFKD": 1, "Lowercase": 1, "Prepend": 1}
"""Most characters of a text a normalizer turns into one (composition merges a character's full
canonical decomposition, at most 4 code points: U+1F82); a normalizer not listed may delete text."""
KEEPING_PRE_TOKENIZERS = {"ByteLevel", "Split", "Digits", "Metaspace", "Punctuation", "UnicodeScripts"}
"""Pre-tokenizers that split text without dropping any of it (unless told to remove: `Removed`)."""


def qwen3_backend(vocab_size: int) -> tuple[Backend, trainers.BpeTrainer]:
    """An untrained BPE backend with Qwen3's pipeline, and a trainer that fills `vocab_size` ids."""
    backend = Backend(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        ]
    )
    backend.post_processor = processors.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(MARKUP_TOKENS),  # the markup tokens are added after training
        min_frequency=2,
        special_tokens=list(CHAT_SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    return backend, trainer


def normalizer_shrink(normalizer: dict[str, Any] | None) -> int:
    """Most characters `normalizer` (tokenizer.json's entry) turns into one; 0: no bound."""
    steps = [] if normalizer is None else normalizer.get("normalizers", [normalizer])
    return math.prod(NORMALIZER_SHRINK.get(step["type"], 0) for step in steps)


def keeps_every_character(layout: dict[str, Any]) -> bool:
    """Whether every character of a text ends up in some token (tokenizer.json's `layout`): a BPE
    that does not fuse unknowns, pre-tokenizers that drop nothing, added tokens that do not
    swallow the whitespace around them."""
    model, pre = layout["model"], layout["pre_tokenizer"]
    steps = [] if pre is None else pre.get("pretokenizers", [pre])
    return (
        model["type"] == "BPE"
        and not (model.get("unk_token") and model.get("fuse_unk"))
        and all(step["type"] in KEEPING_PRE_TOKENIZERS and step.get("behavior") != "Removed" for step in steps)
        and not any(token["lstrip"] or token["rstrip"] for token in layout["added_tokens"])
    )


def default_tokenizer_config() -> dict[str, Any]:
    """The tokenizer_config.json of a trained tokenizer: what AutoTokenizer needs, as Qwen3 writes it."""
    return {
        "tokenizer_class": "Qwen2Tokenizer",
        "bos_token": None,
        "eos_token": IM_END,
        "pad_token": ENDOFTEXT,
        "unk_token": None,
        "add_bos_token": False,
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "split_special_tokens": False,
        "errors": "replace",
        "model_max_length": 131072,
        "chat_template": CHAT_TEMPLATE,
    }


class Tokenizer:
    """Text <-> token ids, plus the ids of the chat control tokens.

    Build one with `Tokenizer.train(texts)` or `Tokenizer.load(folder)`; never construct the
    backend by hand.
    """

    def __init__(self, backend: Backend, config: dict[str, Any], source: str = "<trained>"):
        # A tokenizer.json saved after a truncating or padding call keeps those settings, which
        # would cut or pad every text encoded here (documents, prompts): whetstone encodes whole
        # texts, unpadded, and saves the file as it came (its padding block names a pad token).
        self._saved = backend.to_str(pretty=True)
        backend.no_truncation()
        backend.no_padding()
        self._backend = backend
        self.config = config
        """The tokenizer_config.json written by `save` (a loaded checkpoint's own, untouched)."""
        # A token counts only if text containing it encodes to that one id (as `encode` encodes:
        # without what a post-processor adds, such as a BOS token).
        tokens = CHAT_SPECIAL_TOKENS + MARKUP_TOKENS
        encoded = {token: backend.encode(token, add_special_tokens=False).ids for token in tokens}
        self.special_ids = {token: ids[0] for token, ids in encoded.items() if len(ids) == 1}
        """Id of every chat/tool token this vocabulary has, by its string."""
        missing = [token for token in CHAT_SPECIAL_TOKENS if token not in self.special_ids]
        if missing:
            raise CheckpointError(f"{source}: tokenizer lacks the ChatML tokens {missing}")
        self.endoftext_id: int = self.special_ids[ENDOFTEXT]
        """Separates packed documents (Qwen's document end)."""
        self.im_start_id: int = self.special_ids[IM_START]
        self.im_end_id: int = self.special_ids[IM_END]
        """Ends every chat turn: generation stops here."""
        # Corpus text must never turn a literal "<|endoftext|>" in a source file into a control
        # token, so plain-text encoding uses a twin backend with special-token matching off.
        self._plain = Backend.from_str(backend.to_str())
        self._plain.encode_special_tokens = True
        matched = [
            token
            for token in CHAT_SPECIAL_TOKENS
            if self._plain.encode(token, add_special_tokens=False).ids == [self.special_ids[token]]
        ]
        if matched:  # only tokens flagged special are left unmatched in plain text
            raise CheckpointError(
                f"{source}: the ChatML tokens {matched} are not marked special, so a corpus quoting them "
                'would encode control tokens; set "special": true on them in tokenizer.json\'s added_tokens'
            )

    @classmethod
    def train(cls, texts: Iterable[str], vocab_size: int = 4096, length: int | None = None) -> "Tokenizer":
        """Train byte-level BPE on `texts`; the result has at most `vocab_size` ids, specials included.

        A small corpus may stop short of `vocab_size` (no pair left to merge twice): size the
        model's embedding from `tokenizer.vocab_size`, not from the request.
        """
        if vocab_size < 256 + len(CHAT_SPECIAL_TOKENS) + len(MARKUP_TOKENS):
            raise WhetstoneError(f"vocab_size {vocab_size} is below the 256 byte tokens plus the chat tokens")
        backend, trainer = qwen3_backend(vocab_size)
        backend.train_from_iterator(texts, trainer, length=length)
        backend.add_tokens([AddedToken(token, special=False, normalized=False) for token in MARKUP_TOKENS])
        return cls(backend, default_tokenizer_config())

    @classmethod
    def load(cls, directory: str | Path) -> "Tokenizer":
        """Load `tokenizer.json` (and `tokenizer_config.json` if present) from a checkpoint folder
        (`~` and `$NAME` in `directory` expanded)."""
        directory = expand_path(directory)
        path = directory / "tokenizer.json"
        if not path.is_file():
            raise CheckpointError(f"{path} does not exist")
        try:
            backend = Backend.from_file(str(path))
        except Exception as err:  # the Rust side raises plain Exception on bad JSON or layout
            raise CheckpointError(f"{path} is not a valid tokenizer.json: {err}") from None
        config_path = directory / "tokenizer_config.json"
        config = default_tokenizer_config()
        if config_path.exists():
            try:
                config = json.loads(config_path.read_bytes().decode("utf-8"))
            except IsADirectoryError:
                raise CheckpointError(f"{config_path} is a directory, not a JSON file") from None
            except OSError as err:
                raise CheckpointError(f"{config_path} cannot be read: {err.strerror or err}") from None
            except (json.JSONDecodeError, UnicodeDecodeError) as err:
                raise CheckpointError(f"{config_path} is not valid JSON: {err}") from None
            if not isinstance(config, dict):
                raise CheckpointError(
                    f"{config_path} holds {json.dumps(config)[:40]}, not a JSON object: restore the file, "
                    "or delete it to use whetstone's default tokenizer config"
                )
        return cls(backend, config, source=str(path))

    def save(self, directory: str | Path) -> None:
        """Write tokenizer.json and tokenizer_config.json (each atomically) for AutoTokenizer or `load`."""
        directory = expand_path(directory)
        atomic_write_text(directory / "tokenizer.json", self._saved)
        atomic_write_json(directory / "tokenizer_config.json", self.config)

    @cached_property
    def vocab_size(self) -> int:
        """Largest id in use + 1, added tokens included: the embedding rows a model needs (the
        count of entries is less when a tokenizer.json leaves ids unused)."""
        return max(self._backend.get_vocab(with_added_tokens=True).values()) + 1

    def encode(self, text: str) -> list[int]:
        """Ids of `text`; chat control strings in it become their control tokens. Other threads
        run meanwhile (the batch call releases the GIL, the single one does not), so a long text
        does not stall a server's event loop."""
        return self._backend.encode_batch([text], add_special_tokens=False)[0].ids

    def encode_plain(self, texts: Sequence[str]) -> list[list[int]]:
        """Ids of many documents at once (parallel); control strings in them stay plain text."""
        return [item.ids for item in self._plain.encode_batch_fast(list(texts), add_special_tokens=False)]

    def min_tokens(self, text: str) -> int:
        """A lower bound on `len(encode(text))`, from the length of `text` alone (no encoding):
        a token stands for at most `_chars_per_token` characters. 0 when the pipeline may drop
        text, so nothing is known."""
        per_token = self._chars_per_token[text.isascii()]
        return math.ceil(len(text) / per_token) if per_token else 0

    @cached_property
    def _chars_per_token(self) -> dict[bool, int]:
        """Most characters one token can stand for, for non-ASCII (False) and ASCII (True) text:
        its longest vocabulary entry (byte-level entries have one character per byte), times
        how many characters normalization may merge into one (none in ASCII text). 0 for a
        pipeline that may drop text (a whitespace-removing split, fused unknowns)."""
        layout = json.loads(self._backend.to_str())
        shrink = normalizer_shrink(layout["normalizer"])
        if shrink == 0 or not keeps_every_character(layout):
            return {False: 0, True: 0}
        longest = max(len(token) for token in self._backend.get_vocab(with_added_tokens=True))
        return {False: longest * shrink, True: longest}

    def decode(self, ids: Sequence[int]) -> str:
        """Text of `ids`, control tokens included, so `decode(encode(t)) == t` for NFC text."""
        return self._backend.decode(list(ids), skip_special_tokens=False)

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._backend.id_to_token(token_id)
