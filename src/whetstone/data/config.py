"""The corpus config: where the code comes from, how it is cleaned, split, tokenized and batched.

Every field except `cache_dir`, `seq_len` and `demo_weight` goes into the cache key: change one and
the next build makes a new cache entry; leave them all alone and the build is reused.
"""

from __future__ import annotations

from pydantic import Field, model_validator

from whetstone.config import Config

LOADER_FIELDS = {"cache_dir", "seq_len", "demo_weight"}
"""Fields that only steer where the cache lives or how batches are cut, not what is built."""


class DirectorySource(Config):
    """A directory of source files."""

    path: str = Field(min_length=1)
    """The directory (`~` is expanded)."""
    include: list[str] = ["**/*.py"]
    """Glob patterns, relative to `path`, of the files to read."""
    exclude: list[str] = []
    """Glob patterns, relative to `path`, of files to skip (`dir/**` skips a whole directory)."""


class JsonlSource(Config):
    """A JSON Lines file, one document per line."""

    path: str = Field(min_length=1)
    """The .jsonl file (`~` is expanded)."""
    text_field: str = "text"
    """The key of each line's object that holds the document's text."""


class DedupConfig(Config):
    """Exact and near-duplicate removal (MinHash over token shingles, LSH banding)."""

    near_duplicates: bool = True
    """Also remove near duplicates (exact duplicates are always removed)."""
    threshold: float = Field(0.8, gt=0, le=1)
    """Estimated Jaccard similarity of shingle sets at or above which two documents are duplicates."""
    num_permutations: int = Field(128, ge=8)
    """MinHash signature length."""
    bands: int = Field(16, ge=1)
    """LSH bands (must divide num_permutations); more bands find pairs at lower similarity."""
    shingle_size: int = Field(5, ge=1)
    """Consecutive word/symbol tokens per shingle."""
    seed: int = 0
    """Seed of the MinHash permutations."""

    @model_validator(mode="after")
    def _bands_divide(self) -> "DedupConfig":
        if self.num_permutations % self.bands:
            raise ValueError(f"bands ({self.bands}) must divide num_permutations ({self.num_permutations})")
        return self


class CorpusConfig(Config):
    """The code corpus for mid-training: sources, cleaning, split, tokenizer, packing."""

    stdlib: bool = True
    """Include the running interpreter's standard library source (sysconfig 'stdlib' path)."""
    stdlib_exclude: list[str] = ["site-packages/**", "**/test/**", "**/tests/**", "**/idle_test/**", "config-*/**"]
    """Glob patterns of stdlib .py files to skip: installed packages and the test suites (large,
    and full of deliberately broken or odd files)."""
    directories: list[DirectorySource] = []
    """More directories of source files."""
    jsonl: list[JsonlSource] = []
    """JSON Lines files of documents."""
    min_document_chars: int = Field(64, ge=0)
    """Skip documents shorter than this (empty `__init__.py` files and the like)."""
    max_document_bytes: int = Field(200_000, ge=1)
    """Skip documents larger than this (generated tables and data dumps)."""
    max_total_bytes: int = Field(16_000_000, ge=0)
    """Keep at most this many bytes of documents, chosen by a hash of their names (0 = all). The
    embedded default (the stdlib, about 11 MB) fits; the cap keeps the build under a minute."""
    dedup: DedupConfig = DedupConfig()
    """Duplicate removal."""
    validation_fraction: float = Field(0.05, ge=0, lt=1)
    """Share of documents (whole files) held out for validation, chosen by a hash of their names."""
    split_seed: int = 0
    """Changes which documents the hash puts in validation."""
    tokenizer: str = ""
    """A folder with tokenizer.json (e.g. a Qwen3 checkpoint) to use as is; empty = train a BPE."""
    vocab_size: int = Field(4096, ge=271)
    """Size of the trained BPE vocabulary, control tokens included (the tiny model's vocabulary)."""
    cache_dir: str = "~/.cache/whetstone/corpus"
    """Where built corpora are kept, one folder per cache key."""
    seq_len: int = Field(256, ge=1)
    """Tokens per training sequence (the loader cuts the packed stream into windows of this length)."""
    demo_weight: float = Field(0.1, ge=0, le=1)
    """Share of training sequences drawn from task demonstrations; applies only to a corpus built
    with a demonstration source (otherwise every sequence is code)."""
