"""Mixing task demonstrations into the training stream.

The hook is a `DemoSource`: a callable returning chat transcripts (each a list of OpenAI-shaped
messages, see `whetstone.tokenizer.chat`) made from *train-split* tasks only. The corpus build
renders each with `render_chat` (no `tools` argument: the harness lists its tools in the system
prompt), tokenizes it with `encode_chat`, and packs them into a demonstration stream whose loss
mask keeps only the tokens the assistant wrote.

The loader then draws a fixed share `demo_weight` of training rows from that stream. Row `g` of
the whole run (step * batch_size + r) is a demonstration row when floor((g+1)w) > floor(gw), so
exactly floor(gw) of the first g rows are demonstrations and either stream's row counter is
known in O(1) from g alone: batches stay a pure function of (seed, step).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterable
from fractions import Fraction

import numpy as np

from whetstone.errors import WhetstoneError
from whetstone.tokenizer import Message, Tokenizer, encode_chat

DemoSource = Callable[[], Iterable[list[Message]]]
"""Returns chat transcripts (message lists) of solved train-split tasks."""


def collect_demos(source: DemoSource) -> tuple[list[list[Message]], str]:
    """The transcripts as a list, and a content hash for the cache key."""
    transcripts = [list(messages) for messages in source()]
    digest = hashlib.sha256(json.dumps(transcripts, sort_keys=True, default=str).encode()).hexdigest()
    return transcripts, digest


def pack_demos(
    transcripts: list[list[Message]], tokenizer: Tokenizer, dtype: np.dtype
) -> tuple[np.ndarray, np.ndarray]:
    """(tokens, loss mask) of all transcripts, each followed by `<|endoftext|>` (not trained)."""
    tokens: list[int] = []
    mask: list[bool] = []
    for number, messages in enumerate(transcripts):
        try:
            encoded = encode_chat(tokenizer, messages)
        except WhetstoneError as err:
            raise WhetstoneError(f"demonstration {number}: {err}") from None
        tokens += encoded.ids + [tokenizer.endoftext_id]
        mask += encoded.assistant_mask + [False]
    return np.array(tokens, dtype=dtype), np.array(mask, dtype=bool)


def demo_rows_before(row: int, weight: Fraction) -> int:
    """How many of the rows 0..row-1 of the run are demonstration rows."""
    return row * weight.numerator // weight.denominator


def as_fraction(weight: float) -> Fraction:
    """The weight as an exact fraction (to 1e-6), so row assignment has no float rounding."""
    return Fraction(weight).limit_denominator(1_000_000)
