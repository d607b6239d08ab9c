"""JUnit XML reports, the per-test results of a custom `test_command` (one that is not pytest).

JUnit XML is what every test runner can write (`pytest --junitxml`, `go test` through
go-junit-report, jest-junit, cargo2junit, Maven surefire, unittest-xml-reporting): `<testcase>`
elements, anywhere under `<testsuites>` / `<testsuite>`, each with a `<failure>`, `<error>` or
`<skipped>` child, or none when it passed.

A testcase `<testcase classname="C" name="N" file="F">` answers to these test ids, so that the
ids a task lists (FAIL_TO_PASS, PASS_TO_PASS) can be written the way its test runner names tests:

- `C::N` (`N` alone when there is no classname): go-junit-report (`github.com/o/r/pkg::TestX`),
  cargo2junit, jest-junit, surefire (`com.example.FooTest::bar`);
- `N (C)`: the unittest and Django runners' own spelling (`test_x (app.tests.FooTests)`);
- `F::N` when the testcase names its file (jest-junit's `file` attribute);
- a pytest node id, `path/to/test_m.py::Class::N`, the form of SWE-bench's ids: pytest writes
  the node id's path with dots for slashes and without `.py`, classes appended, into the
  classname (`path.to.test_m.Class`), the `[...]` parameters staying in the name.

Each wanted id is read into the (classname, name) and (file, name) pairs it can stand for, and
these are looked up among the testcases: the work grows with the report's size and the ids',
never with a product of the two, whatever names code under test writes into the report (it can
write the report: see docs/sandbox.md). Names longer than `MAX_NAME_CHARS` or more than
`MAX_TESTCASES` testcases make a report unusable.

When several testcases answer to one id (a test run twice, a rerun plugin's retries), the worst
outcome counts: error, then failed, then skipped, then passed.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import BinaryIO
from xml.parsers import expat

OUTCOME_TAGS = {"failure": "failed", "error": "error", "skipped": "skipped"}
"""A testcase's child element -> its outcome (other children, `system-out` or surefire's
`flakyFailure` of a test that passed on retry, say nothing about the outcome)."""
RANK = {"passed": 0, "skipped": 1, "failed": 2, "error": 3}
"""Outcomes from best to worst: of several for one id, the worst counts."""
MAX_NAME_CHARS = 4096
"""The longest classname, name or file attribute of a testcase that is read (a test id is a
line, not a page); a longer one makes the report unusable."""
MAX_TESTCASES = 100_000
"""The most testcases a report may hold (more than a test run within a grading time limit
reports); more make the report unusable."""


class JUnitError(ValueError):
    """A report that cannot be read as JUnit XML."""


@dataclass(frozen=True)
class JUnitCase:
    """One `<testcase>` of a report: its attributes (`file` None when absent) and outcome."""

    classname: str
    name: str
    file: str | None
    outcome: str

    @property
    def id(self) -> str:
        """`C::N`, or `N` without a classname: the id the testcase counts under when a task lists none."""
        return f"{self.classname}::{self.name}" if self.classname else self.name


def read_testcases(report: BinaryIO) -> list[JUnitCase]:
    """Every `<testcase>` of a JUnit XML report, read as a stream. Raises `JUnitError` for a
    report that is not well-formed XML, is declared in an encoding the parser cannot read, has a
    document type declaration (a JUnit report needs none, and one is how entity-expansion bombs
    are written), or exceeds `MAX_NAME_CHARS` or `MAX_TESTCASES`."""
    testcases: list[JUnitCase] = []
    depth = 0  # of the element opening next
    case: dict | None = None  # the testcase open now
    case_depth = 0  # and its depth

    def start(tag: str, attributes: dict[str, str]) -> None:
        nonlocal depth, case, case_depth
        if tag == "testcase" and case is None:
            for attribute in ("classname", "name", "file"):
                if len(attributes.get(attribute, "")) > MAX_NAME_CHARS:
                    raise JUnitError(
                        f"a testcase's {attribute} is {len(attributes[attribute])} characters long, more than "
                        f"the {MAX_NAME_CHARS} read (line {parser.CurrentLineNumber})"
                    )
            if len(testcases) == MAX_TESTCASES:
                raise JUnitError(f"it holds more than {MAX_TESTCASES} testcases")
            case = {
                "classname": attributes.get("classname", ""),
                "name": attributes.get("name", ""),
                "file": attributes.get("file") or None,
                "outcome": "passed",
            }
            case_depth = depth
        elif case is not None and depth == case_depth + 1 and tag in OUTCOME_TAGS:
            case["outcome"] = worst([case["outcome"], OUTCOME_TAGS[tag]])
        depth += 1

    def end(tag: str) -> None:
        nonlocal depth, case
        depth -= 1
        if case is not None and depth == case_depth:
            testcases.append(JUnitCase(**case))
            case = None

    def doctype(*_) -> None:
        raise JUnitError("it has a document type declaration (<!DOCTYPE ...>), which a JUnit report never needs")

    parser = expat.ParserCreate()
    parser.StartElementHandler = start
    parser.EndElementHandler = end
    parser.StartDoctypeDeclHandler = doctype
    try:
        parser.ParseFile(report)
    except JUnitError:
        raise
    except expat.ExpatError as err:
        raise JUnitError(f"it is not well-formed XML ({expat.ErrorString(err.code)}, line {err.lineno})") from None
    except (ValueError, LookupError) as err:  # an encoding expat cannot use: utf-7, utf-32, cp932, unknown
        raise JUnitError(
            f"its XML declaration names an encoding the parser cannot read ({err}): write it in UTF-8"
        ) from None
    return testcases


def worst(outcomes: Iterable[str]) -> str:
    """The worst of `outcomes` (`RANK`)."""
    return max(outcomes, key=RANK.__getitem__)


def outcomes_by_id(testcases: list[JUnitCase], wanted: list[str]) -> dict[str, str]:
    """The outcome of each id in `wanted` that a testcase answers to (an id no testcase answers
    to is left out: the grader counts it as an error); with no ids wanted, every testcase's
    outcome under its `C::N` id."""
    if not wanted:
        by_id: dict[str, str] = {}
        for testcase in testcases:
            by_id[testcase.id] = worst([by_id.get(testcase.id, "passed"), testcase.outcome])
        return by_id
    by_class: dict[tuple[str, str], str] = {}
    by_file: dict[tuple[str, str], str] = {}
    for testcase in testcases:
        key = (testcase.classname, testcase.name)
        by_class[key] = worst([by_class.get(key, "passed"), testcase.outcome])
        if testcase.file:
            key = (testcase.file, testcase.name)
            by_file[key] = worst([by_file.get(key, "passed"), testcase.outcome])
    found: dict[str, str] = {}
    for test_id in wanted:
        classes, files = _keys(test_id)
        outcomes = [by_class[key] for key in classes if key in by_class]
        outcomes += [by_file[key] for key in files if key in by_file]
        if outcomes:
            found[test_id] = worst(outcomes)
    return found


def _keys(test_id: str) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """The (classname, name) pairs and the (file, name) pairs a testcase answering to `test_id`
    has (the forms of the module's docstring)."""
    parts = test_id.split("::")
    cuts = [("::".join(parts[:cut]), "::".join(parts[cut:])) for cut in range(1, len(parts))]
    classes = [("", test_id), *cuts]  # N alone; C::N, at each `::` (a Rust name holds some)
    if test_id.endswith(")") and " (" in test_id:  # N (C)
        name, _, classname = test_id[:-1].rpartition(" (")
        classes.append((classname, name))
    path, bracket, parameters = test_id.partition("[")  # a pytest node id, split as pytest does
    names = path.split("::")
    if len(names) >= 2 and names[0].endswith(".py"):
        module = names[0].removesuffix(".py").replace("/", ".")
        classes.append((".".join([module, *names[1:-1]]), names[-1] + bracket + parameters))
    return classes, cuts
