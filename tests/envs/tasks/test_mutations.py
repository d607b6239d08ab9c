"""AST mutations: one small, well-placed text edit each, formatting and comments untouched."""

import ast
import inspect
import textwrap

import pytest

from whetstone.envs.tasks.bugs import enclosing_function, failure_line
from whetstone.envs.tasks.mutations import mutation_sites

SOURCE = textwrap.dedent('''\
    # Café prices  (a non-ASCII comment shifts byte offsets)
    def total(prices, limit=10):
        """Sum, capped."""
        amount = 0
        for price in prices:
            amount += price  # running sum
        if amount > limit and not prices == []:
            return limit
        return amount
''')


def _edits(source: str) -> dict[str, set[tuple[str, str]]]:
    edits: dict[str, set[tuple[str, str]]] = {}
    for m in mutation_sites(source):
        edits.setdefault(m.operator, set()).add((m.original, m.replacement))
    return edits


def test_each_operator_finds_its_sites():
    edits = _edits(SOURCE)
    assert (" += ", " -= ") in edits["binop"]
    assert (" > ", " >= ") in edits["compare"] and (" == ", " != ") in edits["compare"]
    assert (" and ", " or ") in edits["boolop"]
    assert ("0", "1") in edits["off_by_one"]
    assert ("not prices == []", "prices == []") in edits["drop_not"]
    assert ("amount > limit and not prices == []", "not (amount > limit and not prices == [])") in edits["negate_if"]
    assert ("limit", "None") in edits["return_none"] and ("amount", "None") in edits["return_none"]
    originals = {original for pairs in edits.values() for original, _ in pairs}
    assert "10" not in originals  # default argument values are left alone


def test_a_mutation_changes_one_line_and_nothing_else():
    for mutation in mutation_sites(SOURCE):
        mutated = mutation.apply(SOURCE)
        before, after = SOURCE.splitlines(), mutated.splitlines()
        changed = [i for i, (a, b) in enumerate(zip(before, after)) if a != b]
        assert len(before) == len(after) and changed == [mutation.line - 1], mutation.describe()
        ast.parse(mutated)
    assert "# running sum" in mutation_sites(SOURCE)[0].apply(SOURCE)


def test_a_file_starting_with_a_byte_order_mark_is_mutated_as_python_reads_it():
    """Python skips a UTF-8 BOM at the start of a file; the edits land where they would without it,
    on the first line too, and the mark stays."""
    source = "\ufeff" + SOURCE.replace("# Café prices", "LIMIT = 1 + 2  # Café prices")
    plain = source.removeprefix("\ufeff")
    sites, plain_sites = mutation_sites(source), mutation_sites(plain)
    assert len(sites) == len(plain_sites) and any(m.line == 1 for m in sites)
    for mutation, plain_mutation in zip(sites, plain_sites):
        assert mutation.apply(source) == "\ufeff" + plain_mutation.apply(plain), mutation.describe()
    assert enclosing_function(source, 3) == "total" and enclosing_function(source, 1) == "<module>"


def test_operator_precedence_is_kept():
    """Only the operator token is swapped, so `c - a * b` becomes `c - a + b`, never `(c - a) * b`."""
    [swap] = [m for m in mutation_sites("x = c - a * b\n") if m.original.strip() == "*"]
    assert swap.apply("x = c - a * b\n") == "x = c - a + b\n"


def test_real_module_gives_many_parsing_mutants():
    import bisect

    source = inspect.getsource(bisect)
    sites = mutation_sites(source)
    assert len(sites) > 40 and len({m.operator for m in sites}) >= 5
    assert all(m.apply(source) != source for m in sites)


@pytest.mark.parametrize("line, name", [(2, "total"), (6, "total"), (1, "<module>")])
def test_enclosing_function(line, name):
    assert enclosing_function(SOURCE, line) == name


def test_enclosing_function_is_qualified():
    source = "class A:\n    def f(self):\n        return 1\n"
    assert enclosing_function(source, 3) == "A.f"


def test_failure_line_reads_the_right_section():
    log = textwrap.dedent("""\
        ________________ TestHeap.test_push ________________
        E   AttributeError: no module
        ________________ TestHeapPython.test_push ________________
            def test_push(self):
        >       assert 1 == 2
        E       assert 1 == 2
        """)
    assert failure_line(log, "test_heapq.py::TestHeapPython::test_push") == "assert 1 == 2"
    assert failure_line(log, "test_heapq.py::test_other") is None
