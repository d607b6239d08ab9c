import inspect
import json.decoder
import shlex
import textwrap

import numpy as np

from whetstone.data import DedupConfig
from whetstone.data.dedup import MinHasher, deduplicate
from whetstone.data.sources import Document

TEXTWRAP = inspect.getsource(textwrap)
SHLEX = inspect.getsource(shlex)
DECODER = inspect.getsource(json.decoder)


def test_minhash_estimates_jaccard_similarity():
    words = [f"w{i}" for i in range(3000)]
    a = " ".join(words[:2000])
    b = " ".join(words[1000:])  # shares half of its 1-word shingles with a: Jaccard 1/3
    hasher = MinHasher(num_permutations=256, shingle_size=1, seed=0)
    estimate = np.mean(hasher.signature(a) == hasher.signature(b))
    assert abs(estimate - 1 / 3) < 0.08
    assert np.array_equal(hasher.signature(a), MinHasher(256, 1, 0).signature(a))  # deterministic


def test_exact_duplicates_keep_the_first_name():
    documents = [Document("a/x.py", TEXTWRAP), Document("b/copy.py", TEXTWRAP), Document("c/y.py", SHLEX)]
    kept, stats = deduplicate(documents, DedupConfig())
    assert [d.name for d in kept] == ["a/x.py", "c/y.py"]
    assert stats["exact_duplicates"] == 1 and stats["examples"] == ["b/copy.py == a/x.py"]


def test_near_duplicates_are_removed_and_distinct_files_kept():
    edited = TEXTWRAP.replace("def dedent(text):", "def dedent(text, margin=None):")
    edited = edited.replace("# -- Loosely", "# Loosely")
    vendored = "# Vendored copy, do not edit.\n" + TEXTWRAP
    documents = [
        Document("a.py", TEXTWRAP),
        Document("b.py", SHLEX),
        Document("c.py", edited),
        Document("d.py", DECODER),
        Document("e.py", vendored),
    ]
    kept, stats = deduplicate(documents, DedupConfig())
    assert [d.name for d in kept] == ["a.py", "b.py", "d.py"]
    assert stats["near_duplicates"] == 2 and stats["near_clusters"] == 1
    assert "c.py ~ a.py" in stats["examples"]


def test_half_overlapping_files_are_not_duplicates():
    half = len(TEXTWRAP) // 2
    documents = [Document("a.py", TEXTWRAP), Document("b.py", TEXTWRAP[:half] + SHLEX)]
    kept, stats = deduplicate(documents, DedupConfig())
    assert len(kept) == 2 and stats["near_duplicates"] == 0


def test_near_duplicate_search_can_be_switched_off():
    documents = [Document("a.py", TEXTWRAP), Document("b.py", "# header\n" + TEXTWRAP)]
    kept, _ = deduplicate(documents, DedupConfig(near_duplicates=False))
    assert len(kept) == 2
