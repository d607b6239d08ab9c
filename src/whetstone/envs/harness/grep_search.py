"""The search of the grep tool (`Workspace.grep`), run as a process of its own.

Python's `re` cannot be interrupted: a pattern that backtracks without end (`(a|aa)+$` on a
long line of `a`s) would hold the harness's process, and every rollout in it, for hours. The
harness runs the search here, with only the standard library (`python -I -S`, about 20 ms to
start), and kills it at its time limit.

Reads a pickled `(pattern, limit, paths)` on stdin: `paths` are (shown name, host path) of the
regular files to search, found and confined to the workspace by the harness, while none of the
agent's commands runs. Writes the pickled list of the first `limit` matching lines as
`name:line:text` (text cut at 300 characters). Files that are gone, unreadable or no longer
regular files are passed over, as the harness passes them over.
"""

import os
import pickle
import re
import stat
import sys


def read(path: str) -> bytes | None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    with open(fd, "rb") as file:
        return file.read() if stat.S_ISREG(os.fstat(fd).st_mode) else None


def search(pattern: str, limit: int, paths: list[tuple[str, str]]) -> list[str]:
    regex, matches = re.compile(pattern), []
    for shown, path in paths:
        data = read(path)
        if data is None:
            continue
        for number, line in enumerate(data.decode("utf-8", "replace").splitlines(), 1):
            if regex.search(line):
                matches.append(f"{shown}:{number}:{line[:300]}")
                if len(matches) >= limit:
                    return matches
    return matches


if __name__ == "__main__":
    pickle.dump(search(*pickle.load(sys.stdin.buffer)), sys.stdout.buffer)
