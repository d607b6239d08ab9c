"""Corpus sources: list the files (cheap, for the cache key), then read them into documents.

A document has a stable name: `stdlib/json/decoder.py`, `<directory as configured>/pkg/mod.py`,
`<jsonl path as configured>:17`. The name decides its train/validation split and its place under
the size cap, so both stay the same when unrelated files come and go or the tree moves.
"""

from __future__ import annotations

import errno
import hashlib
import os
import re
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from stat import S_ISREG

from whetstone.config import expand_path
from whetstone.data.config import CorpusConfig
from whetstone.errors import WhetstoneError
from whetstone.utils.jsonl import json_lines
from whetstone.utils.progress import progress_bar


@dataclass(frozen=True)
class SourceFile:
    name: str
    path: Path
    size: int
    mtime_ns: int
    text_field: str | None = None
    """Set for a JSONL file: the key holding each line's text."""


@dataclass(frozen=True)
class Document:
    name: str
    text: str


def name_hash(name: str, salt: str) -> float:
    """A stable pseudo-random number in [0, 1) for a document name (`salt` picks the sequence).

    A file name that is not UTF-8 comes from `os.walk` with its undecodable bytes as surrogates
    (`surrogateescape`); they are hashed as those bytes, the name's own."""
    digest = hashlib.blake2b(f"{salt}:{name}".encode(errors="surrogateescape"), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2**64


def glob_regex(pattern: str) -> re.Pattern[str]:
    """A glob on relative POSIX paths: `**/` is any number of directories, `*` and `?` stay in one."""
    out, i = "", 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out, i = out + "(?:[^/]*/)*", i + 3
        elif pattern.startswith("**", i):
            out, i = out + ".*", i + 2
        else:
            out, i = out + {"*": "[^/]*", "?": "[^/]"}.get(pattern[i], re.escape(pattern[i])), i + 1
    return re.compile(out + r"\Z")


def _walk(root: Path, prefix: str, include: list[str], exclude: list[str], setting: str) -> list[SourceFile]:
    """The files under `root` that `include` matches and `exclude` does not; `setting` names the
    config field of the excludes, for the error about a file that cannot be read."""
    includes = [glob_regex(p) for p in include]
    excludes = [glob_regex(p) for p in exclude]
    # `dir/**` excludes prune the walk: site-packages alone can hold a hundred thousand files.
    pruned = [glob_regex(p[:-3]) for p in exclude if p.endswith("/**")]
    found = []

    def unreadable(err: OSError) -> None:  # os.walk would leave the folder's files out, unsaid
        if isinstance(err, FileNotFoundError):  # deleted while the walk went (a cache, a build's temporaries)
            return
        folder = err.filename or root
        raise WhetstoneError(
            f"corpus: cannot read the folder {folder} ({err.strerror or err}): add it to {setting}, or fix it"
        )

    for directory, subdirs, names in os.walk(root, onerror=unreadable):
        base = Path(directory).relative_to(root).as_posix()
        base = "" if base == "." else base + "/"
        subdirs[:] = sorted(d for d in subdirs if not any(p.match(base + d) for p in pruned))
        for name in names:
            relative = base + name
            if any(p.match(relative) for p in includes) and not any(p.match(relative) for p in excludes):
                stat = _regular_file_stat(root / relative, setting)
                found.append(SourceFile(f"{prefix}/{relative}", root / relative, stat.st_size, stat.st_mtime_ns))
    return found


def _regular_file_stat(path: Path, setting: str) -> os.stat_result:
    """The stat of the file `path` (a link: of its target). A link to nothing, a loop of links,
    a pipe or a device is refused by name: the read would fail, or wait forever (a pipe)."""
    try:
        stat = path.stat()
    except OSError as err:
        problem = err.strerror or str(err)
        if err.errno == errno.ENOENT and path.is_symlink():
            problem = "a link to nothing"
        raise WhetstoneError(f"corpus: cannot read {path} ({problem}): add it to {setting}, or fix it") from None
    if not S_ISREG(stat.st_mode):
        raise WhetstoneError(f"corpus: {path} is not a regular file: add it to {setting}, or remove it")
    return stat


def list_sources(config: CorpusConfig) -> list[SourceFile]:
    """Every file the config names, sorted by name; nothing is read yet."""
    files: list[SourceFile] = []
    if config.stdlib:
        stdlib = Path(sysconfig.get_paths()["stdlib"])
        files += _walk(stdlib, "stdlib", ["**/*.py"], config.stdlib_exclude, "stdlib_exclude")
    for number, source in enumerate(config.directories):
        root = expand_path(source.path)
        if not root.is_dir():
            raise WhetstoneError(f"corpus: directories[{number}].path {source.path!r} is not a directory")
        files += _walk(root, source.path.rstrip("/"), source.include, source.exclude, f"directories[{number}].exclude")
    for number, source in enumerate(config.jsonl):
        path = expand_path(source.path)
        if not path.is_file():
            what = "is not a file" if path.exists() else "does not exist"  # a folder, a pipe
            raise WhetstoneError(f"corpus: jsonl[{number}].path {source.path!r} {what}")
        stat = path.stat()
        files.append(SourceFile(source.path, path, stat.st_size, stat.st_mtime_ns, source.text_field))
    if not files:
        raise WhetstoneError(
            "corpus is empty: no source files matched (set stdlib = true, or add [[directories]] or [[jsonl]])"
        )
    return sorted(files, key=lambda f: f.name)


def read_documents(files: list[SourceFile], config: CorpusConfig) -> tuple[list[Document], dict[str, int]]:
    """Read, decode and filter the documents; returns them (sorted by name) and what was skipped."""
    stats = dict(files=len(files), undecodable=0, too_small=0, too_large=0, over_cap=0)
    documents: list[Document] = []
    with progress_bar(len(files), "read sources", "file") as bar:
        for file in files:
            if file.text_field is not None:
                candidates = _read_jsonl(file)  # one line at a time: a JSONL file may be larger than memory
            elif file.size > config.max_document_bytes:
                candidates, stats["too_large"] = [], stats["too_large"] + 1
            else:
                text = _decode(_read_bytes(file))
                stats["undecodable"] += text is None
                candidates = [Document(file.name, text)] if text is not None else []
            for document in candidates:
                size = _utf8_size(document.text)
                if size is None:
                    stats["undecodable"] += 1
                elif len(document.text) < config.min_document_chars:
                    stats["too_small"] += 1
                elif size > config.max_document_bytes:
                    stats["too_large"] += 1
                else:
                    documents.append(document)
            bar.update(1)
    read = len(documents)
    documents = _apply_cap(documents, config.max_total_bytes)
    stats["over_cap"] = read - len(documents)
    if not documents:
        raise WhetstoneError(
            f"corpus is empty: every document of {len(files)} files was filtered out "
            f"({stats['too_small']} shorter than min_document_chars, {stats['too_large']} larger than "
            f"max_document_bytes, {stats['undecodable']} not UTF-8 text)"
        )
    stats["documents"] = len(documents)
    return sorted(documents, key=lambda d: d.name), stats


def _read_bytes(file: SourceFile) -> bytes:
    try:
        return file.path.read_bytes()
    except OSError as err:
        raise WhetstoneError(
            f"corpus: cannot read {file.path} ({err.strerror or err}): make it readable, or exclude it, then run again"
        ) from None


def _decode(raw: bytes) -> str | None:
    """UTF-8 text with Unix newlines, or None for binary or non-UTF-8 files."""
    if b"\0" in raw:
        return None
    try:
        return raw.decode("utf-8-sig").replace("\r\n", "\n")
    except UnicodeDecodeError:
        return None


def _utf8_size(text: str) -> int | None:
    """Bytes of `text` in UTF-8, or None when it holds a lone surrogate: valid in JSON (`"\\ud83d"`,
    half of an emoji pair cut in scraped data), but not text that UTF-8 or the tokenizer takes."""
    try:
        return len(text.encode())
    except UnicodeEncodeError:
        return None


def _read_jsonl(file: SourceFile) -> Iterator[Document]:
    """The documents of a JSON Lines file, read a line at a time as they are taken (`utils.jsonl`:
    lines end at a line feed only; a UTF-8 byte order mark is skipped, as for the directory
    sources)."""
    try:
        with file.path.open("rb") as handle:
            for line in json_lines(handle):
                number, record = line.number, line.value
                if line.problem:
                    raise WhetstoneError(f"corpus: {file.path}:{number}: {line.problem}")
                if not isinstance(record, dict) or file.text_field not in record:
                    raise WhetstoneError(f"corpus: {file.path}:{number}: no {file.text_field!r} field")
                text = record[file.text_field]
                if not isinstance(text, str):
                    raise WhetstoneError(
                        f"corpus: {file.path}:{number}: field {file.text_field!r} is {type(text).__name__}, "
                        "not a string"
                    )
                yield Document(f"{file.name}:{number}", text.replace("\r\n", "\n"))
    except OSError as err:  # opening it, or a read error part way through
        raise WhetstoneError(f"corpus: cannot read JSONL file {file.path}: {err}") from None


def _apply_cap(documents: list[Document], max_total_bytes: int) -> list[Document]:
    """Keep documents in name-hash order until the byte budget is spent (0 = keep all)."""
    if not max_total_bytes:
        return documents
    kept, total = [], 0
    for document in sorted(documents, key=lambda d: name_hash(d.name, "cap")):
        size = len(document.text.encode())
        if total + size <= max_total_bytes:
            kept.append(document)
            total += size
    return kept
