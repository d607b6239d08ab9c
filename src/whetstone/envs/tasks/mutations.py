"""AST mutations of Python source (SWE-smith style bug injection), applied as minimal text edits.

Sites are found on the AST, but the edit replaces only the operator or expression text at the
node's position, so the rest of the file (formatting, comments) is untouched and the bug is a
one-token diff, like a real slip. Operators:

    binop       a + b  -> a - b, * -> +, // -> *, ...     (also augmented assignments: += -> -=)
    compare     <  -> <=, == -> !=, in -> not in, ...
    boolop      a and b -> a or b
    off_by_one  3 -> 4 or 2
    bool_flip   True <-> False
    drop_not    not x -> x
    negate_if   if x: -> if not x:  (also while, and the condition of `x if c else y`)
    return_none return expr -> return None
"""

from __future__ import annotations

import ast
from dataclasses import dataclass

from whetstone.utils.python_source import BOM, parse_source

BINOP_SWAPS = {
    "+": "-",
    "-": "+",
    "*": "+",
    "/": "*",
    "//": "*",
    "%": "//",
    "**": "*",
    "&": "|",
    "|": "&",
    "<<": ">>",
    ">>": "<<",
}
BINOP_SYMBOLS = {
    ast.Add: "+",
    ast.Sub: "-",
    ast.Mult: "*",
    ast.Div: "/",
    ast.FloorDiv: "//",
    ast.Mod: "%",
    ast.Pow: "**",
    ast.BitAnd: "&",
    ast.BitOr: "|",
    ast.LShift: "<<",
    ast.RShift: ">>",
}
COMPARE_SWAPS = {
    ast.Lt: ("<", "<="),
    ast.LtE: ("<=", "<"),
    ast.Gt: (">", ">="),
    ast.GtE: (">=", ">"),
    ast.Eq: ("==", "!="),
    ast.NotEq: ("!=", "=="),
    ast.In: ("in", "not in"),
    ast.NotIn: ("not in", "in"),
    ast.Is: ("is", "is not"),
    ast.IsNot: ("is not", "is"),
}


@dataclass(frozen=True)
class Mutation:
    """Replace bytes [start, end) of the UTF-8 source with `replacement`."""

    operator: str
    line: int
    start: int
    end: int
    replacement: str
    original: str

    def apply(self, source: str) -> str:
        data = source.encode()
        return (data[: self.start] + self.replacement.encode() + data[self.end :]).decode()

    def describe(self) -> str:
        return f"{self.operator} at line {self.line}: {self.original!r} -> {self.replacement!r}"


class _SiteFinder(ast.NodeVisitor):
    def __init__(self, source: str):
        self.data = source.encode()
        starts, offset = [], 0
        for line in self.data.splitlines(keepends=True):
            starts.append(offset)
            offset += len(line)
        self.line_starts = starts + [offset]
        if source.startswith(BOM):  # the AST's first line starts after the mark
            self.line_starts[0] = len(BOM.encode())
        self.sites: list[Mutation] = []

    def _start(self, node: ast.AST) -> int:
        return self.line_starts[node.lineno - 1] + node.col_offset  # col offsets count UTF-8 bytes

    def _end(self, node: ast.AST) -> int:
        return self.line_starts[node.end_lineno - 1] + node.end_col_offset

    def _text(self, start: int, end: int) -> str:
        return self.data[start:end].decode()

    def _add(self, operator: str, node: ast.AST, start: int, end: int, replacement: str) -> None:
        original = self._text(start, end)
        if node.lineno == node.end_lineno and original != replacement:  # one-line sites keep diffs small
            self.sites.append(Mutation(operator, node.lineno, start, end, replacement, original))

    def _swap_between(self, operator: str, node: ast.AST, left: ast.AST, right: ast.AST, old: str, new: str) -> None:
        """Swap the operator token found between two operands (only if nothing else is there)."""
        start, end = self._end(left), self._start(right)
        gap = self._text(start, end)
        if gap.strip(" ()") == old:
            self._add(operator, node, start, end, gap.replace(old, new, 1))

    def visit_BinOp(self, node: ast.BinOp) -> None:
        symbol = BINOP_SYMBOLS.get(type(node.op))
        if symbol:
            self._swap_between("binop", node, node.left, node.right, symbol, BINOP_SWAPS[symbol])
        self.generic_visit(node)

    def visit_AugAssign(self, node: ast.AugAssign) -> None:
        symbol = BINOP_SYMBOLS.get(type(node.op))
        if symbol:
            self._swap_between("binop", node, node.target, node.value, symbol + "=", BINOP_SWAPS[symbol] + "=")
        self.generic_visit(node)

    def visit_Compare(self, node: ast.Compare) -> None:
        if len(node.ops) == 1 and type(node.ops[0]) in COMPARE_SWAPS:
            old, new = COMPARE_SWAPS[type(node.ops[0])]
            self._swap_between("compare", node, node.left, node.comparators[0], old, new)
        self.generic_visit(node)

    def visit_BoolOp(self, node: ast.BoolOp) -> None:
        if len(node.values) == 2:
            old, new = ("and", "or") if isinstance(node.op, ast.And) else ("or", "and")
            self._swap_between("boolop", node, node.values[0], node.values[1], old, new)
        self.generic_visit(node)

    def visit_UnaryOp(self, node: ast.UnaryOp) -> None:
        if isinstance(node.op, ast.Not):
            text = self._text(self._start(node), self._end(node))
            self._add("drop_not", node, self._start(node), self._end(node), text[3:].lstrip())
        self.generic_visit(node)

    def visit_Constant(self, node: ast.Constant) -> None:
        start, end = self._start(node), self._end(node)
        if isinstance(node.value, bool):
            self._add("bool_flip", node, start, end, str(not node.value))
        elif isinstance(node.value, int) and self._text(start, end).isdigit():
            self._add("off_by_one", node, start, end, str(node.value + 1))
            if node.value > 0:
                self._add("off_by_one", node, start, end, str(node.value - 1))

    def _negate(self, test: ast.expr) -> None:
        start, end = self._start(test), self._end(test)
        text = self._text(start, end)
        simple = isinstance(test, (ast.Name, ast.Call, ast.Attribute, ast.Subscript))
        self._add("negate_if", test, start, end, f"not {text}" if simple else f"not ({text})")

    def visit_If(self, node: ast.If) -> None:
        self._negate(node.test)
        self.generic_visit(node)

    def visit_While(self, node: ast.While) -> None:
        self._negate(node.test)
        self.generic_visit(node)

    def visit_IfExp(self, node: ast.IfExp) -> None:
        self._negate(node.test)
        self.generic_visit(node)

    def visit_Return(self, node: ast.Return) -> None:
        value = node.value
        if value is not None and not (isinstance(value, ast.Constant) and value.value is None):
            self._add("return_none", value, self._start(value), self._end(value), "None")
        self.generic_visit(node)

    def visit_JoinedStr(self, node: ast.JoinedStr) -> None:
        pass  # positions inside f-strings are unreliable before 3.12; leave them alone

    def visit_arguments(self, node: ast.arguments) -> None:
        pass  # default values change the signature's meaning for every caller; not a subtle bug


def mutation_sites(source: str) -> list[Mutation]:
    """Every mutation this module knows for `source`, in source order; each one still parses."""
    finder = _SiteFinder(source)
    finder.visit(parse_source(source))
    sites = []
    for mutation in sorted(finder.sites, key=lambda m: (m.start, m.operator, m.replacement)):
        try:
            parse_source(mutation.apply(source))
        except SyntaxError:
            continue
        sites.append(mutation)
    return sites
