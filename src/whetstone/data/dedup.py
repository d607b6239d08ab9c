"""Duplicate removal: exact duplicates by content hash, near duplicates by MinHash + LSH.

Near duplicates (the same module vendored twice with a different header, generated codec tables)
would otherwise be memorised, and, split across train and validation, flatter the validation
loss. Each document becomes a set of shingles (runs of `shingle_size` whitespace-separated words); its
MinHash signature holds, per random hash function, the minimum over that set, so two signatures
agree in a fraction of places that estimates the sets' Jaccard similarity. LSH banding finds
candidate pairs without comparing all of them: documents whose signatures agree on a whole band
share a bucket. Candidates at or above `threshold` are merged into clusters; each cluster keeps
its first document by name.
"""

from __future__ import annotations

import hashlib
import zlib

import numpy as np

from whetstone.data.config import DedupConfig
from whetstone.data.sources import Document
from whetstone.utils.progress import progress_bar

EMPTY = np.uint64(2**64 - 1)
"""Signature value of a document without words (real values are below 2^32)."""
CHUNK = 4096


class MinHasher:
    def __init__(self, num_permutations: int, shingle_size: int, seed: int):
        rng = np.random.default_rng(seed)
        # Multiply-shift hashing, ((a*x + b) mod 2^64) >> 32 with odd a: a 2-universal family
        # over 32-bit shingle hashes, no division needed.
        self.a = rng.integers(0, 2**63, size=(num_permutations, 1), dtype=np.uint64) * np.uint64(2) + np.uint64(1)
        self.b = rng.integers(0, 2**63, size=(num_permutations, 1), dtype=np.uint64)
        self.shingle_size = shingle_size

    def shingles(self, text: str) -> np.ndarray:
        """Distinct 32-bit hashes of the document's word k-grams."""
        ids = np.array([zlib.crc32(word.encode()) for word in text.split()], dtype=np.uint64)
        k = min(self.shingle_size, len(ids))
        if k == 0:
            return ids
        grams = np.zeros(len(ids) - k + 1, dtype=np.uint64)
        for offset in range(k):  # polynomial rolling combination, wrapping mod 2^64
            grams = grams * np.uint64(1_000_003) + ids[offset : offset + len(grams)]
        grams ^= grams >> np.uint64(31)  # mix, so the high 32 bits kept below depend on every word
        grams *= np.uint64(0x9E3779B97F4A7C15)
        return np.unique(grams >> np.uint64(32))

    def signature(self, text: str) -> np.ndarray:
        """MinHash signature, one value per hash function (all EMPTY for a text without words)."""
        signature = np.full(len(self.a), EMPTY, dtype=np.uint64)
        shingles = self.shingles(text)
        for start in range(0, len(shingles), CHUNK):
            values = (self.a * shingles[None, start : start + CHUNK] + self.b) >> np.uint64(32)
            np.minimum(signature, values.min(axis=1), out=signature)
        return signature


def near_duplicate_roots(signatures: np.ndarray, bands: int, threshold: float) -> list[int]:
    """For each document, the index of the first document of its near-duplicate cluster."""
    count, length = signatures.shape
    rows = length // bands
    root = list(range(count))

    def find(i: int) -> int:
        while root[i] != i:
            root[i] = root[root[i]]
            i = root[i]
        return i

    empty = (signatures == EMPTY).all(axis=1)  # no words: nothing to compare
    for band in range(bands):
        block = np.ascontiguousarray(signatures[:, band * rows : (band + 1) * rows])
        buckets: dict[bytes, int] = {}
        for i in range(count):
            if empty[i]:
                continue
            first = buckets.setdefault(block[i].tobytes(), i)
            if first != i and np.mean(signatures[first] == signatures[i]) >= threshold:
                a, b = find(first), find(i)
                root[max(a, b)] = min(a, b)  # the earlier document (by name) stays the root
    return [find(i) for i in range(count)]


def deduplicate(documents: list[Document], config: DedupConfig) -> tuple[list[Document], dict]:
    """Drop exact, then near duplicates; `documents` must be sorted by name (the first one stays)."""
    unique: list[Document] = []
    seen: dict[bytes, str] = {}
    examples: list[str] = []
    for document in documents:
        key = hashlib.sha256(document.text.encode()).digest()
        if key in seen:
            if len(examples) < 10:
                examples.append(f"{document.name} == {seen[key]}")
        else:
            seen[key] = document.name
            unique.append(document)
    stats = {"exact_duplicates": len(documents) - len(unique), "near_duplicates": 0, "near_clusters": 0}
    if not config.near_duplicates or len(unique) < 2:
        return unique, {**stats, "examples": examples}

    hasher = MinHasher(config.num_permutations, config.shingle_size, config.seed)
    signatures = np.empty((len(unique), config.num_permutations), dtype=np.uint64)
    with progress_bar(len(unique), "minhash", "doc") as bar:
        for i, document in enumerate(unique):
            signatures[i] = hasher.signature(document.text)
            bar.update(1)
    roots = near_duplicate_roots(signatures, config.bands, config.threshold)
    kept = [document for i, document in enumerate(unique) if roots[i] == i]
    for i, document in enumerate(unique):
        if roots[i] != i and len(examples) < 20:
            examples.append(f"{document.name} ~ {unique[roots[i]].name}")
    stats["near_duplicates"] = len(unique) - len(kept)
    stats["near_clusters"] = len({r for i, r in enumerate(roots) if r != i})
    return kept, {**stats, "examples": examples}
