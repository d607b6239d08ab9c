"""Mixing task demonstrations into the training stream.

The hook is a `DemoSource`: a callable returning chat transcripts (each a list of OpenAI-shaped
messages, see `whetstone.tokenizer.chat`) made from *train-split* tasks only. The corpus build
renders each with `render_chat` (no `tools` argument: the harness lists its tools in the system
prompt), tokenizes it with `encode_chat`, and packs them into a demonstration stream whose loss
mask keeps only the tokens the assistant wrote. What the messages say is text: control strings in
it are broken with `defuse_markup` first (`defuse_transcript`), as the harness does with the tool
results it shows the model, so that a task quoting `<|endoftext|>` or a file holding
`<|im_start|>` can neither end a transcript in the packed stream nor fake a turn.

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
from whetstone.tokenizer import Message, Tokenizer, defuse_all, encode_chat

DemoSource = Callable[[], Iterable[list[Message]]]
"""Returns chat transcripts (message lists) of solved train-split tasks."""


def collect_demos(source: DemoSource) -> tuple[list[list[Message]], str]:
    """The transcripts as a list (defused: `defuse_transcript`), and a content hash of them for
    the cache key."""
    transcripts = [defuse_transcript(list(messages)) for messages in source()]
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
            encoded = encode_chat(tokenizer, defuse_transcript(messages))
        except WhetstoneError as err:
            raise WhetstoneError(f"demonstration {number}: {err}") from None
        tokens += encoded.ids + [tokenizer.endoftext_id]
        mask += encoded.assistant_mask + [False]
    return np.array(tokens, dtype=dtype), np.array(mask, dtype=bool)


def defuse_transcript(messages: list[Message]) -> list[Message]:
    """`messages` with `defuse_markup` applied to every string they hold (contents, tool calls'
    names and arguments, nested in dict arguments too: `defuse_all`), so that each control or
    markup string in them encodes as text, not as the token the chat format reserves for it. A
    transcript with no such string comes back equal; applying it twice changes nothing."""
    return [defuse_all(message) for message in messages]


def demo_rows_before(row: int, weight: Fraction) -> int:
    """How many of the rows 0..row-1 of the run are demonstration rows."""
    return row * weight.numerator // weight.denominator


def as_fraction(weight: float) -> Fraction:
    """The weight as an exact fraction (to 1e-6), so row assignment has no float rounding."""
    return Fraction(weight).limit_denominator(1_000_000)
