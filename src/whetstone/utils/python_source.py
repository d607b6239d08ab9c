"""Python source text parsed as the interpreter reads a file."""

from __future__ import annotations

import ast

BOM = "\ufeff"
"""A UTF-8 byte order mark, decoded: Python runs a file that starts with one; `ast.parse` of the
text refuses it."""


def parse_source(source: str) -> ast.Module:
    """`source`, the text of a Python file, parsed as the interpreter reads the file: a leading
    byte order mark is not code. Positions are as in `source` less the mark."""
    return ast.parse(source.removeprefix(BOM))
