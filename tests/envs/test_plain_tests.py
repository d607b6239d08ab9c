"""`plain_tests.py` gives pytest's outcome for every test it takes, and takes nothing it cannot
run exactly as pytest would. Each case runs both for real, in subprocesses, on the same files."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from whetstone.envs import plain_tests
from whetstone.envs.harness.tools import PLAIN_TESTS_SOURCE, Tools, _pytest_outcomes
from whetstone.envs.sandbox import open_sandbox
from whetstone.envs.task import Task

SOLVE = "def solve(x):\n    return x + 1\n"
TESTS = "from solution import solve\n\n\ndef test_1():\n    assert solve(1) == 2\n\n\ndef test_2():\n    assert solve(2) == 4\n"
PYTEST = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rA", "--tb=short"]

# (solution.py, test files, targets): each is run under pytest and under plain_tests.
CASES = {
    "pass and fail": (SOLVE, {"test_a.py": TESTS}, ["test_a.py"]),
    "exceptions, SystemExit, a return value, a test without underscore": (
        "import sys\ndef solve(x):\n    if x == 0:\n        sys.exit(3)\n    if x < 0:\n        raise ValueError(x)\n    return x\n",
        {"test_b.py": "from solution import solve\n\ndef test_exit():\n    solve(0)\n\ndef test_raise():\n    solve(-1)\n\n"
                      "def testvalue():\n    return solve(5)\n\ndef helper():\n    assert False\n"},
        ["test_b.py"]),
    "a collection error stops every file": (
        "def solve(x)\n    return x\n", {"test_a.py": TESTS, "test_c.py": "def test_ok():\n    pass\n"},
        ["test_c.py", "test_a.py"]),
    "an import-time exception in the solution": (
        "raise RuntimeError('broken')\n", {"test_a.py": TESTS}, ["test_a.py"]),
    "node ids select tests": (SOLVE, {"test_a.py": TESTS}, ["test_a.py::test_2"]),
    "a missing node id runs nothing": (SOLVE, {"test_a.py": TESTS}, ["test_a.py::test_1", "test_a.py::test_9"]),
    "no tests": (SOLVE, {"test_e.py": "from solution import solve\n"}, ["test_e.py"]),
    "output, stdin and a module-level test helper import": (
        "import sys\ndef solve(x):\n    print('x' * 100000)\n    sys.stderr.write('err')\n    return input()\n",
        {"test_f.py": "from solution import solve\nimport math\n\ndef test_reads_stdin():\n    assert solve(1)\n\n"
                      "def test_math():\n    assert math.sqrt(4) == 2\n"},
        ["test_f.py"]),
    "the solution replaces a test before collection": (
        "import sys\nsys.modules['test_g'].test_2 = lambda: None\ndef solve(x):\n    return x\n", {"test_g.py": TESTS.replace("from solution import solve\n", "")
                                                           + "\nfrom solution import solve\n"},
        ["test_g.py"]),
}


def pytest_outcomes(root: Path, targets: list[str]) -> tuple[dict[str, str], int]:
    run = subprocess.run([*PYTEST, *targets], cwd=root, capture_output=True, text=True, stdin=subprocess.DEVNULL,
                         env={"PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1", "PATH": "/usr/bin:/bin"})
    return _pytest_outcomes(run.stdout), run.returncode


def plain_outcomes(root: Path, targets: list[str]) -> tuple[dict[str, str], int]:
    # as grade_runner.py runs it: from the repository, imported before the repository is on the path
    script = ("import json, os, sys\nsys.path[0] = sys.argv[1]\nimport plain_tests\nsys.path[0] = os.getcwd()\n"
              "seen = {}\ncode = plain_tests.run(sys.argv[2:], lambda t, o: seen.__setitem__(t, o))\n"
              "print(json.dumps([seen, code]))\n")
    run = subprocess.run([sys.executable, "-c", script, str(Path(plain_tests.__file__).parent), *targets], cwd=root,
                         capture_output=True, text=True, stdin=subprocess.DEVNULL)
    assert run.returncode == 0, run.stderr
    seen, code = json.loads(run.stdout.splitlines()[-1])
    return seen, code


def write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        (root / name).write_text(text)


@pytest.mark.parametrize("case", list(CASES))
def test_same_outcomes_and_exit_code_as_pytest(case, tmp_path):
    solution, tests, targets = CASES[case]
    write(tmp_path, {"solution.py": solution, **tests})
    assert plain_tests.plan(["-q", "-p", "no:cacheprovider", "-rA", "--tb=short", *targets], str(tmp_path)) == targets
    expected, expected_code = pytest_outcomes(tmp_path, targets)
    seen, code = plain_outcomes(tmp_path, targets)
    # pytest's -rA summary names a collection error by its file, as plain_tests reports it
    assert seen == expected and code == expected_code


@pytest.mark.parametrize("source", [
    "import pytest\n\ndef test_x():\n    pass\n",
    "def test_x(tmp_path):\n    pass\n",
    "import functools\n\n@functools.lru_cache\ndef test_x():\n    pass\n",
    "class TestX:\n    def test_x(self):\n        pass\n",
    "import unittest\n\ndef test_x():\n    pass\n",
    "def test_x():\n    yield 1\n",
    "async def test_x():\n    pass\n",
    "def make():\n    global test_y\n    test_y = make\n\ndef test_x():\n    pass\n",
    "TEST_CASES = [1]\n\ndef test_x():\n    pass\n",
    "from helpers import test_shared\n\ndef test_x():\n    pass\n",
    "from helpers import *\n\ndef test_x():\n    pass\n",
    "def setup_module():\n    pass\n\ndef test_x():\n    pass\n",
    "def test_x():\n    globals()['test_y'] = test_x\n",
    "if True:\n    def test_x():\n        pass\n",
    "def test_x(\n",
])
def test_anything_pytest_would_treat_specially_is_left_to_pytest(source, tmp_path):
    write(tmp_path, {"test_x.py": source})
    assert plain_tests.plan(["test_x.py"], str(tmp_path)) is None


@pytest.mark.parametrize("args,extra", [
    (["-x", "test_a.py"], {}),
    (["-p", "xdist", "test_a.py"], {}),
    (["tests/test_a.py"], {}),
    (["test_a.py", "test_a.py"], {}),
    (["test_missing.py"], {}),
    (["test_a.py"], {"conftest.py": ""}),
    (["test_a.py"], {"pyproject.toml": "[tool.pytest.ini_options]\n"}),
    (["test_a.py"], {"__init__.py": ""}),
    ([], {}),
])
def test_command_lines_and_repositories_pytest_would_configure_are_left_to_pytest(args, extra, tmp_path):
    (tmp_path / "tests").mkdir()
    write(tmp_path, {"test_a.py": TESTS, "tests/test_a.py": TESTS, **extra})
    assert plain_tests.plan(args, str(tmp_path)) is None


def synth_like_task(solution: str) -> Task:
    return Task(id="plain/0", source="test", kind="synthesis", instruction="write solve", split="train",
                repo_files={"solution.py": solution, "test_a.py": TESTS.replace("4", "3")},
                visible_tests=["test_a.py"], hidden_tests={"test_h.py": TESTS.replace("4", "3")},
                protected_paths=["test_*.py"])


@pytest.mark.parametrize("solution,passed", [(SOLVE, True), ("def solve(x):\n    return x\n", False)])
def test_run_tests_answers_from_plain_tests_only_when_every_test_passed(solution, passed):
    task = synth_like_task(solution)
    with open_sandbox(task.repo_files) as sandbox:
        tools = Tools(sandbox, task, max_chars=2000, run_timeout_s=5.0)
        fast = tools._plain_tests_passed(30)
        assert fast == ({"test_a.py::test_1": "passed", "test_a.py::test_2": "passed"} if passed else None)
        # and what the agent reads is pytest's answer either way
        expected = "2 passed" if passed else "FAILED test_a.py::test_1"
        assert tools.call("run_tests", {}, 30).startswith(expected)
        # a run that is not plain is seen so on the host: no sandbox run for the fast path
        (sandbox.workspace / "conftest.py").write_text("")
        assert tools._plain_tests_passed(30) is None
        runs = []
        sandbox.run = lambda *args, **kwargs: runs.append(args)
        assert tools._plain_tests_passed(30) is None and runs == []
        del sandbox.run
        (sandbox.workspace / "conftest.py").unlink()
        # the fast path runs from `python -c`: nothing of it is in the sandbox
        assert "plain_tests" not in tools.call("run", {"command": "ls -a; ls /opt 2>&1"}, 10)
    assert "def plan(" in PLAIN_TESTS_SOURCE
