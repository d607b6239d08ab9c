"""JUnit XML reports: testcases and their outcomes, the ids they answer to, and what is refused."""

import io

import pytest

from whetstone.envs.grading.junit import JUnitCase, JUnitError, outcomes_by_id, read_testcases

# The shapes of pytest's (xunit2), go-junit-report's and a unittest runner's reports, in one file.
REPORT = b"""<?xml version="1.0" encoding="utf-8"?>
<testsuites>
  <testsuite name="pytest" tests="4">
    <testcase classname="tests.test_calc" name="test_add" time="0.001" />
    <testcase classname="tests.test_calc.TestDivide" name="test_zero[0-1]" time="0.001">
      <failure message="ZeroDivisionError">trace</failure>
    </testcase>
    <testcase classname="tests.test_calc" name="test_later"><skipped message="not yet" /></testcase>
    <testcase classname="tests.test_calc" name="test_fixture"><error message="fixture broke" /></testcase>
  </testsuite>
  <testsuite name="github.com/o/r/pkg">
    <testcase classname="github.com/o/r/pkg" name="TestParse"><system-out>ok</system-out></testcase>
  </testsuite>
  <testsuite name="app">
    <testcase classname="app.tests.ViewTests" name="test_index" file="app/tests.py" />
  </testsuite>
</testsuites>
"""


def test_testcases_and_their_outcomes_anywhere_in_the_report():
    cases = read_testcases(io.BytesIO(REPORT))
    assert [(case.name, case.outcome) for case in cases] == [
        ("test_add", "passed"),
        ("test_zero[0-1]", "failed"),
        ("test_later", "skipped"),
        ("test_fixture", "error"),
        ("TestParse", "passed"),
        ("test_index", "passed"),
    ]


def test_ids_in_each_runners_spelling():
    wanted = [
        "tests/test_calc.py::test_add",  # a pytest node id (SWE-bench's form)
        "tests/test_calc.py::TestDivide::test_zero[0-1]",
        "tests.test_calc::test_later",  # classname::name
        "github.com/o/r/pkg::TestParse",  # go-junit-report
        "test_index (app.tests.ViewTests)",  # unittest / Django
        "app/tests.py::ViewTests::test_index",  # from the file attribute
        "app/tests.py::test_index",
        "tests/test_calc.py::test_missing",
    ]
    assert outcomes_by_id(read_testcases(io.BytesIO(REPORT)), wanted) == {
        "tests/test_calc.py::test_add": "passed",
        "tests/test_calc.py::TestDivide::test_zero[0-1]": "failed",
        "tests.test_calc::test_later": "skipped",
        "github.com/o/r/pkg::TestParse": "passed",
        "test_index (app.tests.ViewTests)": "passed",
        "app/tests.py::ViewTests::test_index": "passed",
        "app/tests.py::test_index": "passed",
    }


def test_without_ids_every_testcase_counts_under_classname_and_name():
    cases = read_testcases(io.BytesIO(REPORT))
    assert list(outcomes_by_id(cases, [])) == [
        "tests.test_calc::test_add",
        "tests.test_calc.TestDivide::test_zero[0-1]",
        "tests.test_calc::test_later",
        "tests.test_calc::test_fixture",
        "github.com/o/r/pkg::TestParse",
        "app.tests.ViewTests::test_index",
    ]


def test_a_test_reported_twice_counts_with_its_worst_outcome():
    cases = [JUnitCase("t", "test_flaky", None, "passed"), JUnitCase("t", "test_flaky", None, "failed")]
    assert outcomes_by_id(cases, ["t::test_flaky"]) == {"t::test_flaky": "failed"}
    assert outcomes_by_id(cases, []) == {"t::test_flaky": "failed"}


def test_an_outcome_inside_a_testcases_output_is_not_its_outcome():
    report = b'<testsuite><testcase classname="t" name="ok"><system-out><failure/></system-out></testcase></testsuite>'
    assert [case.outcome for case in read_testcases(io.BytesIO(report))] == ["passed"]


@pytest.mark.parametrize(
    "report, reason",
    [
        (b"<testsuite><testcase name='a'>", "it is not well-formed XML (no element found, line 1)"),
        (b"PASSED everything", "it is not well-formed XML (syntax error, line 1)"),
        (
            b'<!DOCTYPE t [<!ENTITY a "aaaa"><!ENTITY b "&a;&a;&a;">]><testsuite><testcase name="&b;"/></testsuite>',
            "it has a document type declaration (<!DOCTYPE ...>), which a JUnit report never needs",
        ),
    ],
)
def test_what_is_not_a_junit_report_is_refused(report, reason):
    with pytest.raises(JUnitError) as refused:
        read_testcases(io.BytesIO(report))
    assert str(refused.value) == reason
