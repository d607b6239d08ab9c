"""Corpus statistics that give the validation loss a scale."""

from __future__ import annotations

import numpy as np


def unigram_entropy(tokens: np.ndarray, vocab_size: int) -> float:
    """Entropy of the token frequencies, in nats/token: the loss of a model that ignores context."""
    counts = np.bincount(tokens, minlength=vocab_size).astype(np.float64)
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())


def unigram_cross_entropy(train: np.ndarray, val: np.ndarray, vocab_size: int) -> float:
    """Validation loss (nats/token) of the train split's unigram model, add-one smoothed."""
    counts = np.bincount(train, minlength=vocab_size).astype(np.float64) + 1
    log_p = np.log(counts / counts.sum())
    return float(-log_p[val].mean())
