"""JUnit XML reports: testcases and their outcomes, the ids they answer to, and what is refused."""

import io
import os
import subprocess
import sys
import tracemalloc

import pytest

from whetstone.envs.grading.junit import (
    MAX_NAME_CHARS,
    MAX_TESTCASES,
    JUnitCase,
    JUnitError,
    outcomes_by_id,
    read_testcases,
)

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


def test_ids_with_colons_in_the_name_and_without_a_classname():
    """cargo2junit names a test by its Rust path (`tests::it_works`), under the crate as classname."""
    cases = [
        JUnitCase("mycrate", "tests::it_works", None, "passed"),
        JUnitCase("", "standalone (not a class)", None, "failed"),
        JUnitCase("pkg", "test_x[a::b]", "pkg.py", "skipped"),
    ]
    wanted = ["mycrate::tests::it_works", "standalone (not a class)", "pkg.py::test_x[a::b]", "mycrate::it_works"]
    assert outcomes_by_id(cases, wanted) == {
        "mycrate::tests::it_works": "passed",
        "standalone (not a class)": "failed",
        "pkg.py::test_x[a::b]": "skipped",
    }


def test_pytest_ids_under_a_folder_with_a_dot_match_pytests_own_report(tmp_path):
    """pytest's --junitxml writes `tests/v1.2/test_d.py::TestK::test_k[a::b]` as classname
    `tests.v1.2.test_d.TestK`, name `test_k[a::b]`: the id is read, not the classname cut."""
    folder = tmp_path / "tests" / "v1.2"
    folder.mkdir(parents=True)
    (folder / "test_d.py").write_text(
        "import pytest\n\n\ndef test_dot():\n    pass\n\n\nclass TestK:\n"
        "    @pytest.mark.parametrize('x', ['a::b'])\n    def test_k(self, x):\n        assert x == 'c'\n"
    )
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--rootdir={tmp_path}"]
    command += ["--junitxml=report.xml", "tests/v1.2/test_d.py"]
    env = {**os.environ, "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}
    subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, check=False)
    with open(tmp_path / "report.xml", "rb") as report:
        cases = read_testcases(report)
    assert {(case.classname, case.name) for case in cases} == {
        ("tests.v1.2.test_d", "test_dot"),
        ("tests.v1.2.test_d.TestK", "test_k[a::b]"),
    }
    wanted = ["tests/v1.2/test_d.py::test_dot", "tests/v1.2/test_d.py::TestK::test_k[a::b]"]
    assert outcomes_by_id(cases, wanted) == {wanted[0]: "passed", wanted[1]: "failed"}


def test_matching_costs_memory_in_proportion_to_the_report_not_to_its_dots():
    """Code under test can write the report: classnames of thousands of dots must not each turn
    into thousands of candidate ids, each as long as the classname (664 MB for a 32 KB report)."""
    classname = "a." * (MAX_NAME_CHARS // 2 - 1) + "T"
    report = "".join(f'<testcase classname="{classname}" name="test_{n}"/>' for n in range(10))
    cases = read_testcases(io.BytesIO(f"<testsuite>{report}</testsuite>".encode()))
    for wanted in (["a/a.py::T::test_0", "x.py::test_1"], []):
        tracemalloc.start()
        try:
            outcomes_by_id(cases, wanted)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert peak < 1 << 20, f"{peak} bytes to match {len(report)} bytes of report"


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
        (
            b'<?xml version="1.0" encoding="utf-7"?><testsuite><testcase name="a"/></testsuite>',
            "its XML declaration names an encoding the parser cannot read (multi-byte encodings are not "
            "supported): write it in UTF-8",
        ),
        (
            b'<?xml version="1.0" encoding="utf-32"?><testsuite><testcase name="a"/></testsuite>',
            "its XML declaration names an encoding the parser cannot read (multi-byte encodings are not "
            "supported): write it in UTF-8",
        ),
        (
            b'<?xml version="1.0" encoding="cp932"?><testsuite><testcase name="a"/></testsuite>',
            "its XML declaration names an encoding the parser cannot read (multi-byte encodings are not "
            "supported): write it in UTF-8",
        ),
        (
            b'<?xml version="1.0" encoding="bogus"?><testsuite><testcase name="a"/></testsuite>',
            "its XML declaration names an encoding the parser cannot read (unknown encoding: bogus): write it in UTF-8",
        ),
        (
            b'<testsuite><testcase classname="%s" name="a"/></testsuite>' % (b"c" * (MAX_NAME_CHARS + 1)),
            f"a testcase's classname is {MAX_NAME_CHARS + 1} characters long, more than the {MAX_NAME_CHARS} read "
            "(line 1)",
        ),
        (
            b'<testsuite>\n<testcase name="%s"/></testsuite>' % (b"n" * (MAX_NAME_CHARS + 1)),
            f"a testcase's name is {MAX_NAME_CHARS + 1} characters long, more than the {MAX_NAME_CHARS} read (line 2)",
        ),
        (
            b'<testsuite><testcase name="a" file="%s"/></testsuite>' % (b"f" * (MAX_NAME_CHARS + 1)),
            f"a testcase's file is {MAX_NAME_CHARS + 1} characters long, more than the {MAX_NAME_CHARS} read (line 1)",
        ),
        (
            b"<testsuite>" + b'<testcase name="a"/>' * (MAX_TESTCASES + 1) + b"</testsuite>",
            f"it holds more than {MAX_TESTCASES} testcases",
        ),
        (b"<testsuite><testcase name='a'>", "it is not well-formed XML (no element found, line 1)"),
        (b"PASSED everything", "it is not well-formed XML (syntax error, line 1)"),
        (
            b'<!DOCTYPE t [<!ENTITY a "aaaa"><!ENTITY b "&a;&a;&a;">]><testsuite><testcase name="&b;"/></testsuite>',
            "it has a document type declaration (<!DOCTYPE ...>), which a JUnit report never needs",
        ),
    ],
    ids=[
        "utf-7",
        "utf-32",
        "cp932",
        "unknown-encoding",
        "long-classname",
        "long-name",
        "long-file",
        "too-many-testcases",
        "truncated",
        "not-xml",
        "doctype",
    ],
)
def test_what_is_not_a_junit_report_is_refused(report, reason):
    with pytest.raises(JUnitError) as refused:
        read_testcases(io.BytesIO(report))
    assert str(refused.value) == reason
