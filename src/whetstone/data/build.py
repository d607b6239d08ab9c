"""Build the corpus once per cache key: read, deduplicate, split, tokenize, pack, write.

The cache key hashes the config (minus `LOADER_FIELDS`), the listing of every source file (name,
size, mtime), the tokenizer files when one is given, the version of the tokenizer's encoding
procedure (`ENCODING_VERSION`: the same files may encode otherwise) and the demonstrations, so a
changed input makes a new build and an unchanged one is reused. A build is written into a
temporary folder that replaces `<cache_dir>/<key>` only once complete, manifest included, and
holds the lock `<cache_dir>/<key>.lock`: a process that finds the entry missing while another
builds it waits, then uses that build.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import logging
import os
import shutil
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from whetstone.config import expand_path
from whetstone.data.config import LOADER_FIELDS, CorpusConfig
from whetstone.data.dedup import deduplicate
from whetstone.data.loader import MANIFEST_VERSION, Corpus
from whetstone.data.mix import DemoSource, collect_demos, pack_demos
from whetstone.data.packing import pack, token_dtype
from whetstone.data.sources import Document, SourceFile, list_sources, name_hash, read_documents
from whetstone.data.stats import unigram_cross_entropy, unigram_entropy
from whetstone.errors import CheckpointError, WhetstoneError
from whetstone.tokenizer import Message, Tokenizer
from whetstone.tokenizer.bpe import ENCODING_VERSION
from whetstone.utils.atomic import atomic_directory, atomic_write_json, write_errors
from whetstone.utils.progress import progress_bar

ENCODE_CHUNK = 64

log = logging.getLogger("whetstone.data")
NO_FLOCK = {errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL}
"""What `flock` fails with on a file system that does not lock."""


def build_corpus(config: CorpusConfig, demos: DemoSource | None = None, *, rebuild: bool = False) -> Corpus:
    """The built corpus for `config` (and demonstrations), from the cache when it is there."""
    files = list_sources(config)
    transcripts, demo_hash = collect_demos(demos) if demos is not None else ([], None)
    key = cache_key(config, files, demo_hash)
    path = expand_path(config.cache_dir) / key
    if rebuild or not (path / "manifest.json").exists():
        with build_lock(path) as locked:  # another process may have built it while this one waited
            if rebuild or not (path / "manifest.json").exists():
                for leftover in path.parent.glob(f".{key}.*.tmp") if locked else ():  # of a killed build
                    shutil.rmtree(leftover, ignore_errors=True)
                with atomic_directory(path) as tmp:
                    _build_into(tmp, config, files, transcripts, key)
    return Corpus.open(path)


@contextmanager
def build_lock(path: Path) -> Iterator[bool]:
    """Hold the lock on building the cache entry `path` (the file `<key>.lock` beside it, there
    while held), waiting while another process holds it; yields whether it is held. Two processes
    building one entry at once (two runs started together) would both do the work, and the
    second to finish would swap the first's folder away under it. The kernel lets go of the lock
    when its holder dies. A file system without `flock` (Lustre without `-o flock`, NFS without
    its lock service) builds unlocked, saying so."""
    lock_file = path.with_name(f"{path.name}.lock")
    with write_errors(lock_file):
        path.parent.mkdir(parents=True, exist_ok=True)
    while True:
        with write_errors(lock_file):
            fd = os.open(lock_file, os.O_RDONLY | os.O_CREAT, 0o666)  # read-only: another user's file locks too
        try:
            locked = _lock(fd, path)
            if locked and _same_file(fd, lock_file):
                break  # not a lock file its holder deleted while this process waited on it
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)
        if not locked:
            log.warning("%s cannot be locked on its file system: building the corpus without a lock", lock_file)
            yield False
            return
    try:
        yield True
    finally:
        lock_file.unlink(missing_ok=True)  # while held: whoever waits on it finds it gone and locks a new one
        os.close(fd)


def _lock(fd: int, path: Path) -> bool:
    """Take `fd`'s exclusive `flock`, waiting (and saying so) while another process holds it;
    False where the file system has no `flock` (`NO_FLOCK`)."""
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.warning("waiting for another process building the corpus %s", path)
            fcntl.flock(fd, fcntl.LOCK_EX)
    except OSError as err:
        if err.errno in NO_FLOCK:
            return False
        raise
    return True


def _same_file(fd: int, path: Path) -> bool:
    try:
        stat = path.stat()
    except FileNotFoundError:
        return False
    opened = os.fstat(fd)
    return (stat.st_dev, stat.st_ino) == (opened.st_dev, opened.st_ino)


def _build_into(
    folder: Path, config: CorpusConfig, files: list[SourceFile], transcripts: list[list[Message]], key: str
) -> None:
    started, started_cpu = time.perf_counter(), time.process_time()
    seconds: dict[str, float] = {}

    @contextmanager
    def stage(name: str):
        begin = time.perf_counter()
        yield
        seconds[name] = round(time.perf_counter() - begin, 2)

    with stage("read"):
        documents, source_stats = read_documents(files, config)
    with stage("dedup"):
        documents, dedup_stats = deduplicate(documents, config.dedup)
        train, val = split_documents(documents, config.validation_fraction, config.split_seed)
    with stage("tokenizer"):
        if config.tokenizer:
            tokenizer = Tokenizer.load(config.tokenizer)
        else:  # trained on the train split only: validation text stays unseen
            with progress_bar(None, "train tokenizer", "run") as bar:  # one call: elapsed time only
                tokenizer = Tokenizer.train((d.text for d in train), config.vocab_size, length=len(train))
                bar.update(1)
        tokenizer.save(folder / "tokenizer")
    with stage("encode"):
        dtype = token_dtype(tokenizer.vocab_size)
        train_tokens = pack(encode_documents(tokenizer, train, "tokenize train"), tokenizer.endoftext_id, dtype)
        val_tokens = pack(encode_documents(tokenizer, val, "tokenize val"), tokenizer.endoftext_id, dtype)
        np.save(folder / "train.npy", train_tokens)
        np.save(folder / "val.npy", val_tokens)
        demo_stats = None
        if transcripts:
            demo_tokens, demo_mask = pack_demos(transcripts, tokenizer, dtype)
            np.save(folder / "demo_tokens.npy", demo_tokens)
            np.save(folder / "demo_mask.npy", demo_mask)
            demo_stats = {"transcripts": len(transcripts), "tokens": len(demo_tokens), "trained": int(demo_mask.sum())}

    train_bytes = sum(len(d.text.encode()) for d in train)
    atomic_write_json(folder / "documents.json", {"train": [d.name for d in train], "val": [d.name for d in val]})
    manifest = {
        "format_version": MANIFEST_VERSION,
        "key": key,
        "config": config.model_dump(mode="json"),
        "python": sys.version.split()[0],
        "sources": source_stats,
        "dedup": dedup_stats,
        "split": {
            "train_documents": len(train),
            "val_documents": len(val),
            "train_bytes": train_bytes,
            "val_bytes": sum(len(d.text.encode()) for d in val),
        },
        "tokenizer": {
            "source": config.tokenizer or "trained",
            "vocab_size": tokenizer.vocab_size,
            "endoftext_id": tokenizer.endoftext_id,
        },
        "tokens": {"train": len(train_tokens), "val": len(val_tokens), "dtype": dtype.name},
        "bytes_per_token": train_bytes / max(1, len(train_tokens) - len(train)),  # separators excluded
        "unigram_entropy": unigram_entropy(train_tokens, tokenizer.vocab_size),
        "val_unigram_cross_entropy": unigram_cross_entropy(train_tokens, val_tokens, tokenizer.vocab_size),
        "demos": demo_stats,
        "build_seconds": round(time.perf_counter() - started, 2),
        "build_cpu_seconds": round(time.process_time() - started_cpu, 2),  # all threads of the process
        "stage_seconds": seconds,
    }
    atomic_write_json(folder / "manifest.json", manifest)  # last: its presence means complete


def cache_key(config: CorpusConfig, files: list[SourceFile], demo_hash: str | None) -> str:
    recipe = {
        "format_version": MANIFEST_VERSION,
        "config": config.model_dump(mode="json", exclude=LOADER_FIELDS),
        "files": [(f.name, f.size, f.mtime_ns) for f in files],
        "demos": demo_hash,
        "encoding_version": ENCODING_VERSION,
    }
    if config.tokenizer:
        folder = expand_path(config.tokenizer)
        recipe["tokenizer"] = [_file_hash(folder / n) for n in ("tokenizer.json", "tokenizer_config.json")]
    return hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:16]


def split_documents(
    documents: list[Document], validation_fraction: float, seed: int
) -> tuple[list[Document], list[Document]]:
    """Whole documents to validation by a hash of their names; at least one on each side."""
    if len(documents) < 2:
        raise WhetstoneError(f"corpus has {len(documents)} document(s) after deduplication; need at least 2")
    scores = {d.name: name_hash(d.name, f"split:{seed}") for d in documents}
    val = [d for d in documents if scores[d.name] < validation_fraction]
    if not val:  # a tiny corpus: hold out the document the hash ranks first
        val = [min(documents, key=lambda d: scores[d.name])]
    if len(val) == len(documents):
        val.remove(max(val, key=lambda d: scores[d.name]))
    held = {d.name for d in val}
    return [d for d in documents if d.name not in held], val


def encode_documents(tokenizer: Tokenizer, documents: list[Document], description: str) -> list[list[int]]:
    ids: list[list[int]] = []
    with progress_bar(len(documents), description, "doc") as bar:
        for start in range(0, len(documents), ENCODE_CHUNK):
            chunk = documents[start : start + ENCODE_CHUNK]
            ids += tokenizer.encode_plain([d.text for d in chunk])
            bar.update(len(chunk))
    return ids


def _file_hash(path: Path) -> str | None:
    """SHA-256 of the file `path`, None where there is none; one that cannot be read (a folder,
    another user's file) is named, as `Tokenizer.load` would."""
    if not path.exists():
        return None
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError as err:
        raise CheckpointError(f"{path} cannot be read: {err.strerror or err}") from None
