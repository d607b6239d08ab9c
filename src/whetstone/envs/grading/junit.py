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
  classname (`path.to.test_m.Class`), so each way of cutting C into a module and classes is
  one id; a `.py` file F (pytest's `xunit1` reports) gives `F::Class::N` directly.

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


class JUnitError(ValueError):
    """A report that cannot be read as JUnit XML."""


@dataclass(frozen=True)
class JUnitCase:
    """One `<testcase>` of a report: its attributes (`file` None when absent) and outcome."""

    classname: str
    name: str
    file: str | None
    outcome: str

    def ids(self) -> list[str]:
        """The test ids this testcase answers to (see the module's docstring), its `C::N` first."""
        classname, name = self.classname, self.name
        ids = [f"{classname}::{name}" if classname else name]
        if classname:
            ids.append(f"{name} ({classname})")
        if self.file:
            ids.append(f"{self.file}::{name}")
            module = self.file.removesuffix(".py").replace("/", ".")
            if self.file.endswith(".py") and (classname + ".").startswith(module + "."):
                ids.append("::".join([self.file, *filter(None, classname[len(module) :].split(".")), name]))
        parts = classname.split(".") if classname else []
        for cut in range(1, len(parts) + 1):
            ids.append("::".join(["/".join(parts[:cut]) + ".py", *parts[cut:], name]))
        return list(dict.fromkeys(ids))


def read_testcases(report: BinaryIO) -> list[JUnitCase]:
    """Every `<testcase>` of a JUnit XML report, read as a stream. Raises `JUnitError` for a
    report that is not well-formed XML, or that has a document type declaration: a JUnit report
    needs none, and one is how entity-expansion bombs are written."""
    testcases: list[JUnitCase] = []
    depth = 0  # of the element opening next
    case: dict | None = None  # the testcase open now
    case_depth = 0  # and its depth

    def start(tag: str, attributes: dict[str, str]) -> None:
        nonlocal depth, case, case_depth
        if tag == "testcase" and case is None:
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
    except expat.ExpatError as err:
        raise JUnitError(f"it is not well-formed XML ({expat.ErrorString(err.code)}, line {err.lineno})") from None
    return testcases


def worst(outcomes: Iterable[str]) -> str:
    """The worst of `outcomes` (`RANK`)."""
    return max(outcomes, key=RANK.__getitem__)


def outcomes_by_id(testcases: list[JUnitCase], wanted: list[str]) -> dict[str, str]:
    """The outcome of each id in `wanted` that a testcase answers to (an id no testcase answers
    to is left out: the grader counts it as an error); with no ids wanted, every testcase's
    outcome under its first id (`C::N`)."""
    found: dict[str, list[str]] = {}
    for testcase in testcases:
        for test_id in testcase.ids() if wanted else testcase.ids()[:1]:
            found.setdefault(test_id, []).append(testcase.outcome)
    if not wanted:
        return {test_id: worst(outcomes) for test_id, outcomes in found.items()}
    return {test_id: worst(found[test_id]) for test_id in wanted if test_id in found}
