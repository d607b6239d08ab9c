"""The search of the grep tool (`Workspace.grep`), run as a process of its own.

Python's `re` cannot be interrupted: a pattern that backtracks without end (`(a|aa)+$` on a
long line of `a`s) would hold the harness's process, and every rollout in it, for hours. The
harness runs the search here, with only the standard library (`python -I -S`, about 20 ms to
start), and kills it at its time limit.

Reads a pickled `(pattern, limit, paths)` on stdin: `paths` are (shown name, host path) of the
regular files to search, found and confined to the workspace by the harness, while none of the
agent's commands runs. Writes the pickled list of the first `limit` matching lines as
`name:line:text` (text cut at 300 characters), numbered as grep and sed number them: a line ends
at a line feed only (`str.splitlines` also ends one at a form feed, U+2028 and others, and would
shift every number after one). A binary file (a NUL in its first `BINARY_PROBE` bytes, as
`read_file` tells one) gives one `name: binary file matches` instead of its bytes as text.
Files are read a line at a time, never held whole. Files that are gone, unreadable or no longer
regular files are passed over, as the harness passes them over.
"""

import io
import os
import pickle
import re
import stat
import sys

BINARY_PROBE = 8192
"""Bytes looked at for a NUL, as `Workspace.read_file` looks."""


def open_regular(path: str) -> io.BufferedReader | None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        return None
    return open(fd, "rb")


def search(pattern: str, limit: int, paths: list[tuple[str, str]]) -> list[str]:
    regex, matches = re.compile(pattern), []
    for shown, path in paths:
        file = open_regular(path)
        if file is None:
            continue
        with file:
            binary = b"\0" in file.read(BINARY_PROBE)
            file.seek(0)
            for number, raw in enumerate(file, 1):
                line = raw.removesuffix(b"\n").removesuffix(b"\r").decode("utf-8", "replace")
                if regex.search(line):
                    matches.append(f"{shown}: binary file matches" if binary else f"{shown}:{number}:{line[:300]}")
                    if len(matches) >= limit:
                        return matches
                    if binary:
                        break
    return matches


if __name__ == "__main__":
    pickle.dump(search(*pickle.load(sys.stdin.buffer)), sys.stdout.buffer)
