"""A built corpus on disk, and the batches a trainer reads from it.

`TrainLoader.batch_at(step)` is a pure function of (seed, step): a resumed run asks for step N
and gets bit-for-bit the batch the first run would have seen, with no iterator state to save.
Underneath, training rows are numbered through the whole run and `batch_from(row)` is the batch
starting at row `row`: a run that resumes with another batch size goes on at the row where it
stopped (its position counted in rows), reading the rows it would have read. Each stream (code,
demonstrations) is visited in epochs; every epoch is a fresh permutation of its windows seeded by
(seed, stream, epoch).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cached_property, lru_cache
from pathlib import Path
from typing import Any

import numpy as np
import torch

from whetstone.data.mix import as_fraction, demo_rows_before
from whetstone.data.packing import document_positions, document_starts, window_count, windows
from whetstone.errors import WhetstoneError
from whetstone.tokenizer import Tokenizer

MANIFEST_VERSION = 1
IGNORE_INDEX = -100
"""Target value of tokens that are not trained on (torch's cross_entropy default ignore_index)."""


@dataclass
class Batch:
    input_ids: torch.Tensor
    """[B, T] int64 token ids."""
    targets: torch.Tensor
    """[B, T] int64 next-token ids; IGNORE_INDEX where there is nothing to learn (prompt and tool
    output in demonstration rows)."""
    position_ids: torch.Tensor
    """[B, T] int64 position of each token within its document (0 at each document start)."""
    document_ids: torch.Tensor
    """[B, T] int64 document number of each token within its row (0, 1, ...)."""
    is_demo: torch.Tensor
    """[B] bool: the row comes from the demonstrations (to log their loss apart)."""


class Corpus:
    """A built corpus folder: manifest.json, tokenizer/, train.npy, val.npy [, demo_*.npy]."""

    def __init__(self, path: Path, manifest: dict[str, Any]):
        self.path = path
        self.manifest = manifest
        """Everything measured at build time (counts, dedup, tokens, entropy); see docs/data.md."""
        try:
            tokens, demos = manifest["tokens"], manifest.get("demos")
            self.train_tokens: np.ndarray = _load_stream(path / "train.npy", tokens["train"])
            self.val_tokens: np.ndarray = _load_stream(path / "val.npy", tokens["val"])
            self.demo_tokens: np.ndarray | None = None
            self.demo_mask: np.ndarray | None = None
            if demos:
                self.demo_tokens = _load_stream(path / "demo_tokens.npy", demos["tokens"])
                self.demo_mask = _load_stream(path / "demo_mask.npy", demos["tokens"])
        except (KeyError, TypeError) as err:
            raise _damaged_corpus(path, f"manifest.json lacks {err}") from None

    @classmethod
    def open(cls, path: str | Path) -> "Corpus":
        path = Path(path)
        try:
            manifest = json.loads((path / "manifest.json").read_text())
        except FileNotFoundError:
            raise WhetstoneError(f"{path} is not a built corpus (no manifest.json)") from None
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
            raise _damaged_corpus(path, f"manifest.json cannot be read: {err}") from None
        if not isinstance(manifest, dict):
            raise _damaged_corpus(path, "manifest.json holds no object")
        if manifest.get("format_version") != MANIFEST_VERSION:
            raise WhetstoneError(
                f"{path}: corpus format {manifest.get('format_version')}, this whetstone reads {MANIFEST_VERSION}"
            )
        return cls(path, manifest)

    @cached_property
    def tokenizer(self) -> Tokenizer:
        return Tokenizer.load(self.path / "tokenizer")

    @property
    def eos_id(self) -> int:
        return self.manifest["tokenizer"]["endoftext_id"]

    @property
    def vocab_size(self) -> int:
        return self.manifest["tokenizer"]["vocab_size"]

    @property
    def unigram_entropy(self) -> float:
        """Nats/token of the train split's unigram distribution (compare with the validation loss)."""
        return self.manifest["unigram_entropy"]

    def train_loader(self, batch_size: int, seq_len: int, seed: int = 0, demo_weight: float = 0.0) -> "TrainLoader":
        """Training batches; `demo_weight` is the share of rows from demonstrations (if built with any)."""
        return TrainLoader(self, batch_size, seq_len, seed, demo_weight)

    def val_batches(self, batch_size: int, seq_len: int) -> Iterator[Batch]:
        """Every validation window once, in order (the last batch may be smaller); always the same."""
        _check_batch_shape(batch_size, seq_len)
        count = window_count(len(self.val_tokens), seq_len)
        if count == 0:
            raise WhetstoneError(f"{self.path}: validation split has {_too_few(self.val_tokens, seq_len)}")
        for start in range(0, count, batch_size):
            rows = windows(self.val_tokens, np.arange(start, min(start + batch_size, count)), seq_len)
            yield make_batch(rows, None, self.eos_id, demo_rows=0)


class TrainLoader:
    """Training batches [batch_size, seq_len] by step; see the module docstring."""

    def __init__(self, corpus: Corpus, batch_size: int, seq_len: int, seed: int, demo_weight: float):
        if seed < 0:
            raise WhetstoneError(f"data loader seed must be >= 0 (got {seed})")
        _check_batch_shape(batch_size, seq_len)
        if not 0 <= demo_weight <= 1:  # NaN too: a weight outside would skip rows of either stream
            raise WhetstoneError(f"demo_weight must be between 0 and 1 (got {demo_weight})")
        self.corpus, self.batch_size, self.seq_len, self.seed = corpus, batch_size, seq_len, seed
        self.code_windows = window_count(len(corpus.train_tokens), seq_len)
        if self.code_windows == 0:
            raise WhetstoneError(f"{corpus.path}: train split has {_too_few(corpus.train_tokens, seq_len)}")
        has_demos = corpus.demo_tokens is not None
        # Demonstration rows start where a transcript starts (and run on into the next ones).
        self.demo_starts = (
            document_starts(np.asarray(corpus.demo_tokens), corpus.eos_id, seq_len) if has_demos else None
        )
        self.demo_windows = 0 if self.demo_starts is None else len(self.demo_starts)
        if self.demo_windows and demo_weight > 0:
            _check_prompts_fit(corpus, seq_len, self.demo_starts)
        if has_demos and demo_weight > 0 and self.demo_windows == 0:
            raise WhetstoneError(f"{corpus.path}: demonstrations have {_too_few(corpus.demo_tokens, seq_len)}")
        self.demo_weight = as_fraction(demo_weight if has_demos else 0.0)
        """The share of rows actually drawn from demonstrations (0 when the corpus has none)."""

    def batch_at(self, step: int) -> Batch:
        """Batch number `step`: rows step * batch_size onward (`batch_from`)."""
        return self.batch_from(step * self.batch_size)

    def batch_from(self, first: int) -> Batch:
        """The `batch_size` rows from row `first` of the run's row sequence, which depends on the
        seed and `demo_weight` but not on the batch size."""
        code_rows, demo_rows = [], []
        for row in range(first, first + self.batch_size):
            before = demo_rows_before(row, self.demo_weight)
            if demo_rows_before(row + 1, self.demo_weight) > before:
                demo_rows.append(self._window_index(1, before, self.demo_windows))
            else:
                code_rows.append(self._window_index(0, row - before, self.code_windows))
        rows = windows(self.corpus.train_tokens, np.array(code_rows, dtype=np.int64), self.seq_len)
        trained = np.ones_like(rows, dtype=bool)
        if demo_rows:
            index = np.array(demo_rows, dtype=np.int64)
            rows = np.concatenate([rows, windows(self.corpus.demo_tokens, index, self.seq_len, self.demo_starts)])
            trained = np.concatenate([trained, windows(self.corpus.demo_mask, index, self.seq_len, self.demo_starts)])
        return make_batch(rows, trained, self.corpus.eos_id, demo_rows=len(demo_rows))

    def batches(self, start_step: int = 0) -> Iterator[Batch]:
        """batch_at(start_step), batch_at(start_step + 1), ... forever."""
        step = start_step
        while True:
            yield self.batch_at(step)
            step += 1

    def _window_index(self, stream: int, count: int, windows_per_epoch: int) -> int:
        """The window that is the `count`-th row drawn from `stream` in this run."""
        epoch, offset = divmod(count, windows_per_epoch)
        return int(_permutation(self.seed, stream, epoch, windows_per_epoch)[offset])


def _check_prompts_fit(corpus: Corpus, seq_len: int, starts: np.ndarray) -> None:
    """Refuse a `seq_len` too short for any transcript's prompt: a row starting at that
    transcript would hold no assistant token, so it would train on nothing."""
    mask = np.asarray(corpus.demo_mask)
    trained = np.append(np.flatnonzero(mask), np.iinfo(np.int64).max)  # sentinel: none after the last
    first_trained = trained[np.searchsorted(trained, starts)]
    short = np.flatnonzero(first_trained - starts > seq_len)  # the last target is token seq_len of a row
    if len(short):
        raise WhetstoneError(
            f"{corpus.path}: a demonstration row of seq_len={seq_len} holds no assistant token when it starts "
            f"at transcript {short[0]} ({len(short)} of {len(starts)} transcripts have a longer prompt): "
            f"raise data.seq_len or set demo_weight = 0"
        )


def _check_batch_shape(batch_size: int, seq_len: int) -> None:
    if batch_size < 1 or seq_len < 1:
        raise WhetstoneError(f"batch_size and seq_len must be >= 1 (got {batch_size} and {seq_len})")


def _damaged_corpus(path: Path, problem: str) -> WhetstoneError:
    """The error for a corpus folder whose files do not match its manifest (a copy cut short, a
    file changed or deleted by hand): a built corpus is only ever put in place whole."""
    return WhetstoneError(
        f"{path} is a damaged corpus build ({problem}): delete the folder and run again to rebuild it"
    )


def _load_stream(file: Path, length: int) -> np.ndarray:
    """The 1-D array in `file` (memory-mapped), which the manifest says holds `length` values."""
    try:
        array = np.load(file, mmap_mode="r")
    except (OSError, ValueError) as err:  # missing, cut short, or no .npy file
        raise _damaged_corpus(file.parent, f"{file.name}: {getattr(err, 'strerror', None) or err}") from None
    if array.shape != (length,):
        raise _damaged_corpus(file.parent, f"{file.name} holds shape {array.shape}, the manifest says ({length},)")
    return array


def _too_few(tokens: np.ndarray, seq_len: int) -> str:
    return f"{len(tokens)} tokens, fewer than seq_len + 1 = {seq_len + 1}"


@lru_cache(maxsize=4)
def _permutation(seed: int, stream: int, epoch: int, size: int) -> np.ndarray:
    return np.random.default_rng([seed, stream, epoch]).permutation(size)


def make_batch(rows: np.ndarray, trained: np.ndarray | None, eos_id: int, demo_rows: int) -> Batch:
    """A batch from rows of seq_len + 1 tokens, the last `demo_rows` of them demonstrations;
    `trained[r, t]` says whether token t is a target."""
    inputs = rows[:, :-1].astype(np.int64)
    targets = rows[:, 1:].astype(np.int64)
    if trained is not None:
        targets[~trained[:, 1:]] = IGNORE_INDEX
    positions, documents = document_positions(inputs, eos_id)
    is_demo = np.arange(len(rows)) >= len(rows) - demo_rows
    arrays = (inputs, targets, positions, documents, is_demo)
    return Batch(*(torch.from_numpy(np.ascontiguousarray(a)) for a in arrays))
