"""Packing: documents joined into one token stream, cut into fixed-length training windows.

Every document is followed by `<|endoftext|>`, so the model learns where files end and a window
may span several documents. Window `i` of length `seq_len` covers stream[i*seq_len : (i+1)*seq_len]
as inputs and the same span shifted by one as targets; the tail shorter than a window is unused.
A trainer that must not attend across documents gets each token's document number and its
position counted from its document's start (both restart in every window).
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np


def token_dtype(vocab_size: int) -> np.dtype:
    """The narrowest unsigned dtype holding every id (uint16 for the tiny vocabulary)."""
    return np.dtype(np.uint16 if vocab_size <= 2**16 else np.uint32)


def pack(documents: Iterable[list[int]], eos_id: int, dtype: np.dtype) -> np.ndarray:
    """One stream: each document's ids followed by `eos_id`."""
    pieces = []
    for ids in documents:
        pieces.append(np.asarray(ids, dtype=dtype))
        pieces.append(np.array([eos_id], dtype=dtype))
    return np.concatenate(pieces) if pieces else np.zeros(0, dtype=dtype)


def window_count(stream_length: int, seq_len: int) -> int:
    """How many full windows (seq_len inputs plus one more token for the last target) fit."""
    return max(0, (stream_length - 1) // seq_len)


def windows(stream: np.ndarray, indices: np.ndarray, seq_len: int, starts: np.ndarray | None = None) -> np.ndarray:
    """Rows of seq_len + 1 tokens: row r is window indices[r] (inputs = row[:-1], targets = row[1:]).
    Window i starts at token i * seq_len, or at `starts[i]` when given; a window from `starts`
    that runs past the stream's end goes on from its beginning (`document_starts`)."""
    if starts is None:
        return stream[indices[:, None] * seq_len + np.arange(seq_len + 1)[None, :]]
    return stream[(starts[indices][:, None] + np.arange(seq_len + 1)[None, :]) % len(stream)]


def document_starts(stream: np.ndarray, eos_id: int, seq_len: int) -> np.ndarray:
    """Offsets of the documents (each ended by `eos_id`) a window of seq_len + 1 tokens starts at:
    every one, as long as the stream holds a window. A window starting mid-transcript would
    train an answer without its question; one starting at one of the last documents runs on into
    the first (`windows`), so the last are trained as often as the others."""
    if len(stream) < seq_len + 1:
        return np.zeros(0, dtype=np.int64)
    return np.concatenate([[0], np.flatnonzero(stream[:-1] == eos_id) + 1]).astype(np.int64)


def document_positions(inputs: np.ndarray, eos_id: int) -> tuple[np.ndarray, np.ndarray]:
    """Per input token: its position within its document and its document number in the row.

    A document starts at the row's first token and right after every `eos_id`; the EOS itself
    belongs to the document it ends.
    """
    rows, length = inputs.shape
    starts = np.zeros((rows, length), dtype=bool)
    starts[:, 0] = True
    starts[:, 1:] = inputs[:, :-1] == eos_id
    document_ids = np.cumsum(starts, axis=1) - 1
    index = np.broadcast_to(np.arange(length), (rows, length))
    last_start = np.maximum.accumulate(np.where(starts, index, 0), axis=1)
    return index - last_start, document_ids
