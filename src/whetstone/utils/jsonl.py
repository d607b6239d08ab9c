"""Reading JSON Lines files: one JSON value a line.

Lines end at a line feed only. `str.splitlines` would also cut at U+2028, U+2029 and U+0085,
which JSON strings may hold raw (`json.dumps(..., ensure_ascii=False)` and pydantic write them
so), and would split one record in two. Each line is decoded on its own, so a line that is not
UTF-8 is that line's problem, not the whole file's.
"""

from __future__ import annotations

import codecs
import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class JsonLine:
    """One non-blank line of a JSON Lines file: its number (from 1) and its value, or the
    problem that kept it from being read (then `value` is None)."""

    number: int
    value: object = None
    problem: str | None = None


def json_lines(lines: Iterable[bytes]) -> Iterator[JsonLine]:
    """The non-blank lines of `lines` (a file opened in binary mode, or `data.split(b"\\n")`),
    parsed one at a time. A UTF-8 byte order mark before the first line is skipped."""
    for number, raw in enumerate(lines, 1):
        if number == 1 and raw.startswith(codecs.BOM_UTF8):
            raw = raw[len(codecs.BOM_UTF8) :]
        if not raw.strip():
            continue
        try:
            value = json.loads(raw.decode("utf-8"))
        except UnicodeDecodeError as err:
            yield JsonLine(number, problem=f"not UTF-8 text: {err}")
        except (ValueError, RecursionError) as err:  # JSONDecodeError; an integer of over 4,300 digits; nesting
            yield JsonLine(number, problem=f"not valid JSON: {err}")
        else:
            yield JsonLine(number, value)


def read_json_lines(path: Path) -> Iterator[JsonLine]:
    """The lines of the JSON Lines file at `path`, read as they are consumed (large files are
    never held whole). OSError (a missing file, a directory) comes from the first `next`."""
    with path.open("rb") as handle:
        yield from json_lines(handle)
