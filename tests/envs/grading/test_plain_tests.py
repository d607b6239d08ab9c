"""`plain_tests.py` gives pytest's outcome for every test it takes, and takes nothing it cannot
run exactly as pytest would. Each case runs both for real, in subprocesses, on the same files."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from whetstone.envs.grading.in_sandbox import plain_tests
from whetstone.envs.harness.tools import PLAIN_TESTS_SOURCE, Tools, _pytest_outcomes
from whetstone.envs.sandbox import open_sandbox
from whetstone.envs.task import Task

SOLVE = "def solve(x):\n    return x + 1\n"
TESTS = (
    "from solution import solve\n\n\ndef test_1():\n    assert solve(1) == 2\n\n\n"
    "def test_2():\n    assert solve(2) == 4\n"
)
PYTEST = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rA", "--tb=short"]

# (solution.py, test files, targets): each is run under pytest and under plain_tests.
CASES = {
    "pass and fail": (SOLVE, {"test_a.py": TESTS}, ["test_a.py"]),
    "exceptions, SystemExit, a return value, a test without underscore": (
        "import sys\ndef solve(x):\n    if x == 0:\n        sys.exit(3)\n"
        "    if x < 0:\n        raise ValueError(x)\n    return x\n",
        {
            "test_b.py": "from solution import solve\n\ndef test_exit():\n    solve(0)\n\n"
            "def test_raise():\n    solve(-1)\n\n"
            "def testvalue():\n    return solve(5)\n\ndef helper():\n    assert False\n"
        },
        ["test_b.py"],
    ),
    "a collection error stops every file": (
        "def solve(x)\n    return x\n",
        {"test_a.py": TESTS, "test_c.py": "def test_ok():\n    pass\n"},
        ["test_c.py", "test_a.py"],
    ),
    "an import-time exception in the solution": ("raise RuntimeError('broken')\n", {"test_a.py": TESTS}, ["test_a.py"]),
    "node ids select tests": (SOLVE, {"test_a.py": TESTS}, ["test_a.py::test_2"]),
    "a missing node id runs nothing": (SOLVE, {"test_a.py": TESTS}, ["test_a.py::test_1", "test_a.py::test_9"]),
    "no tests": (SOLVE, {"test_e.py": "from solution import solve\n"}, ["test_e.py"]),
    "output, stdin and a module-level test helper import": (
        "import sys\ndef solve(x):\n    print('x' * 100000)\n    sys.stderr.write('err')\n    return input()\n",
        {
            "test_f.py": "from solution import solve\nimport math\n\ndef test_reads_stdin():\n    assert solve(1)\n\n"
            "def test_math():\n    assert math.sqrt(4) == 2\n"
        },
        ["test_f.py"],
    ),
    "the solution replaces a test before collection": (
        "import sys\nsys.modules['test_g'].test_2 = lambda: None\ndef solve(x):\n    return x\n",
        {"test_g.py": TESTS.replace("from solution import solve\n", "") + "\nfrom solution import solve\n"},
        ["test_g.py"],
    ),
}


def pytest_outcomes(root: Path, targets: list[str]) -> tuple[dict[str, str], int]:
    run = subprocess.run(
        [*PYTEST, *targets],
        cwd=root,
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
        env={"PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1", "PATH": "/usr/bin:/bin"},
    )
    return _pytest_outcomes(run.stdout), run.returncode


def plain_outcomes(root: Path, targets: list[str], explained: bool = False) -> tuple[dict[str, str], int]:
    # as grade_runner.py runs it: from the repository, imported before the repository is on the path;
    # `explained`: as run_tests runs it, asserts rewritten and failures explained
    explain = ", explain=lambda t, text: None" if explained else ""
    script = (
        "import json, os, sys\nsys.path[0] = sys.argv[1]\nimport plain_tests\nsys.path[0] = os.getcwd()\n"
        f"seen = {{}}\ncode = plain_tests.run(sys.argv[2:], lambda t, o: seen.__setitem__(t, o){explain})\n"
        "print(json.dumps([seen, code]))\n"
    )
    run = subprocess.run(
        [sys.executable, "-c", script, str(Path(plain_tests.__file__).parent), *targets],
        cwd=root,
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
    )
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
    # pytest's -rA summary names a collection error by its file, as plain_tests reports it
    for explained in (False, True):
        seen, code = plain_outcomes(tmp_path, targets, explained)
        assert seen == expected and code == expected_code, explained


def test_rewritten_asserts_evaluate_each_operand_once_in_order_and_name_the_values(tmp_path):
    tests = (
        "calls = []\n\ndef f(x):\n    calls.append(x)\n    return x\n\n"
        "def test_compare():\n    assert f(1) + 1 == f(3)\n\n"
        "def test_truth():\n    assert f([])\n\n"
        "def test_message():\n    assert f(0), 'mine'\n\n"
        "def test_chain():\n    assert 1 < f(0) < 2\n\n"
        "def test_passes():\n    assert f(5) in [5]\n\n"
        "def test_calls():\n    assert calls == [1, 3, [], 0, 0, 5]\n"
    )
    write(tmp_path, {"test_r.py": tests})
    explained = {}
    sys.path.insert(0, str(tmp_path))
    try:
        os.chdir(tmp_path)
        outcomes = {}
        plain_tests.run(["test_r.py"], outcomes.__setitem__, explain=explained.__setitem__)
    finally:
        os.chdir(Path(__file__).parent)
        sys.path.remove(str(tmp_path))
        sys.modules.pop("test_r", None)
    assert outcomes == {
        "test_r.py::test_compare": "failed",
        "test_r.py::test_truth": "failed",
        "test_r.py::test_message": "failed",
        "test_r.py::test_chain": "failed",
        "test_r.py::test_passes": "passed",
        "test_r.py::test_calls": "passed",
    }
    assert explained["test_r.py::test_compare"].endswith("    assert f(1) + 1 == f(3)\nE   assert 2 == 3")
    assert explained["test_r.py::test_truth"].endswith("E   assert []")
    assert explained["test_r.py::test_message"].endswith("E   AssertionError: mine")
    assert explained["test_r.py::test_chain"].endswith("E   assert False")  # only its result


@pytest.mark.parametrize(
    "source",
    [
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
    ],
)
def test_anything_pytest_would_treat_specially_is_left_to_pytest(source, tmp_path):
    write(tmp_path, {"test_x.py": source})
    assert plain_tests.plan(["test_x.py"], str(tmp_path)) is None


@pytest.mark.parametrize(
    "args,extra",
    [
        (["-x", "test_a.py"], {}),
        (["-p", "xdist", "test_a.py"], {}),
        (["tests/test_a.py"], {}),
        (["test_a.py", "test_a.py"], {}),
        (["test_missing.py"], {}),
        (["test_a.py"], {"conftest.py": ""}),
        (["test_a.py"], {"pyproject.toml": "[tool.pytest.ini_options]\n"}),
        (["test_a.py"], {"__init__.py": ""}),
        ([], {}),
    ],
)
def test_command_lines_and_repositories_pytest_would_configure_are_left_to_pytest(args, extra, tmp_path):
    (tmp_path / "tests").mkdir()
    write(tmp_path, {"test_a.py": TESTS, "tests/test_a.py": TESTS, **extra})
    assert plain_tests.plan(args, str(tmp_path)) is None


def synth_like_task(solution: str) -> Task:
    return Task(
        id="plain/0",
        source="test",
        kind="synthesis",
        instruction="write solve",
        split="train",
        repo_files={"solution.py": solution, "test_a.py": TESTS.replace("4", "3")},
        visible_tests=["test_a.py"],
        hidden_tests={"test_h.py": TESTS.replace("4", "3")},
        protected_paths=["test_*.py"],
    )


BROKEN = {
    "all pass": SOLVE,
    "a failed comparison, with output": "def solve(x):\n    print('solving', x)\n    return x\n",
    "an exception in the solution": "def solve(x):\n    return x + None\n",
    "a syntax error": "def solve(x)\n    return x\n",
}


@pytest.mark.parametrize("case", list(BROKEN))
def test_run_tests_reads_like_pytest_without_starting_it(case):
    task = synth_like_task(BROKEN[case])
    with open_sandbox(task.repo_files) as sandbox:
        tools = Tools(sandbox, task, max_chars=2000, run_timeout_s=5.0)
        runs = []
        real_run = sandbox.run
        sandbox.run = lambda command, **kwargs: runs.append(command) or real_run(command, **kwargs)
        fast = tools.call("run_tests", {}, 30)
        assert len(runs) == 1 and runs[0][:2] == ["python", "-c"]  # one sandbox run, no pytest
        # what pytest says, with a conftest.py that makes the run not plain (and changes nothing else)
        (sandbox.workspace / "conftest.py").write_text("")
        slow = tools.call("run_tests", {}, 30)
        assert len(runs) == 2 and "pytest" in runs[1]
        del sandbox.run
    if case == "all pass":
        assert fast == slow == "2 passed"
        return
    # The same verdict, the same failure lines; pytest adds its own explanations (`+  where ...`)
    # and position markers, and calls the captured output "stdout call".
    assert fast.splitlines()[:2] == slow.splitlines()[:2]
    pytest_lines = slow.replace("Captured stdout call", "Captured output").splitlines()
    assert [line for line in fast.splitlines() if line not in pytest_lines and not line.startswith("-")] == []
    assert fast.rstrip().endswith("[exit code 1]" if "syntax" not in case else "[exit code 2]")
    expected = {
        "a failed comparison, with output": ["E   assert 1 == 2", "solving 1"],
        "an exception in the solution": ["solution.py:2: in solve", "E   TypeError: unsupported operand"],
        "a syntax error": ["ERROR test_a.py", "E   SyntaxError: expected ':'"],
    }[case]
    assert all(text in fast for text in expected), fast


def test_run_tests_falls_back_to_pytest_where_the_run_is_not_plain():
    task = synth_like_task(SOLVE)
    with open_sandbox(task.repo_files) as sandbox:
        tools = Tools(sandbox, task, max_chars=2000, run_timeout_s=5.0)
        (sandbox.workspace / "conftest.py").write_text("")
        runs = []
        sandbox.run = lambda *args, **kwargs: runs.append(args)
        assert tools._plain_run(30) is None and runs == []  # seen on the host: no sandbox run for it
        del sandbox.run
        (sandbox.workspace / "conftest.py").unlink()
        # the fast path runs from `python -c`: nothing of it is in the sandbox
        assert "plain_tests" not in tools.call("run", {"command": "ls -a; ls /opt 2>&1"}, 10)
    assert "def plan(" in PLAIN_TESTS_SOURCE


SWAP_AT_IMPORT = (  # the hidden test imports the solution after its tests: replace them in the module
    "import sys\nmodule = sys.modules.get('test_h')\nif module is not None:\n"
    "    module.test_1 = module.test_2 = lambda: None\n\n\ndef solve(x):\n    return x\n"
)
SWAP_FROM_A_THREAD = (  # works whatever the import order: swap the test functions' code once they exist
    "import sys, threading, time\n\n\ndef _swap():\n    for _ in range(2000):\n"
    "        module = sys.modules.get('test_h')\n        if module is not None and hasattr(module, 'test_2'):\n"
    "            for name in ('test_1', 'test_2'):\n"
    "                getattr(module, name).__code__ = (lambda: None).__code__\n"
    "            return\n        time.sleep(0.001)\n\n\nthreading.Thread(target=_swap, daemon=True).start()\n\n\n"
    "def solve(x):\n    time.sleep(0.05)\n    return x\n"
)


@pytest.mark.parametrize(
    "solution,late_import", [(SWAP_AT_IMPORT, True), (SWAP_FROM_A_THREAD, False)], ids=["at import", "from a thread"]
)
def test_grading_runs_the_test_files_own_code_and_flags_replaced_tests(solution, late_import):
    from whetstone.envs.grading.grade import grade

    hidden = TESTS.replace("4", "3")
    if late_import:
        hidden = hidden.replace("from solution import solve\n", "") + "\nfrom solution import solve\n"
    task = Task(
        id="plain/swap",
        source="test",
        kind="synthesis",
        instruction="write solve",
        split="train",
        repo_files={"solution.py": "def solve(x):\n    raise NotImplementedError\n"},
        hidden_tests={"test_h.py": hidden},
        solution_files={"solution.py": SOLVE},
        fail_to_pass=["test_h.py::test_1", "test_h.py::test_2"],
        protected_paths=["test_*.py"],
    )
    honest = grade(task, {"solution.py": SOLVE})
    assert honest.passed and honest.cheat_flags == []
    result = grade(task, {"solution.py": solution})
    assert not result.passed and result.reward == 0.0
    assert any(flag.startswith("test_replaced: test_h.py::test_") for flag in result.cheat_flags), result.cheat_flags
    assert all(outcome == "failed" for outcome in result.tests.values()), result.tests


PYTEST_HIDDEN = (  # a class and a fixture: not a plain run, so grading runs under pytest
    "import pytest\n\n\nclass TestSolve:\n    def test_1(self):\n        assert solve(1) == 2\n\n\n"
    "@pytest.mark.parametrize('x', [2])\ndef test_2(x, tmp_path):\n    assert solve(x) == 3\n\n\n"
    "from solution import solve  # noqa: E402\n"
)
SWAP_IN_PYTEST_AT_IMPORT = (  # imported after the tests: replace them in the namespace of whoever imports it
    "import sys\n\n\ndef _pass(self):\n    pass\n\n\ndef _two(x, tmp_path):\n    pass\n\n\nframe = sys._getframe(1)\n"
    "while frame is not None and 'TestSolve' not in frame.f_globals:\n    frame = frame.f_back\n"
    "if frame is not None:\n    names = frame.f_globals\n    names['TestSolve'].test_1 = _pass\n"
    "    _two.pytestmark = names['test_2'].pytestmark  # keep the parametrization\n    names['test_2'] = _two\n\n\n"
    "def solve(x):\n    return x\n"
)
SWAP_CLASS_IN_PYTEST = (  # a class of another name in place of the test class, the function as well
    "import sys\n\n\ndef _two(x, tmp_path):\n    pass\n\n\nframe = sys._getframe(1)\n"
    "while frame is not None and 'TestSolve' not in frame.f_globals:\n    frame = frame.f_back\n"
    "if frame is not None:\n    names = frame.f_globals\n"
    "    names['TestSolve'] = type('Other', (), {'test_1': lambda self: None})\n"
    "    _two.pytestmark = names['test_2'].pytestmark\n    names['test_2'] = _two\n\n\n"
    "def solve(x):\n    return x\n"
)
SWAP_CODE_IN_PYTEST = (  # swap the test functions' code once they exist, from a thread
    "import sys, threading, time\n\n\ndef _swap():\n    for _ in range(2000):\n"
    "        module = sys.modules.get('test_h')\n"
    "        if module is not None and hasattr(module, 'test_2'):\n"
    "            module.TestSolve.test_1.__code__ = (lambda self: None).__code__\n"
    "            module.test_2.__code__ = (lambda x, tmp_path: None).__code__\n            return\n"
    "        time.sleep(0.001)\n\n\nthreading.Thread(target=_swap, daemon=True).start()\n\n\n"
    "def solve(x):\n    time.sleep(0.05)\n    return x\n"
)


@pytest.mark.parametrize(
    "solution",
    [SWAP_IN_PYTEST_AT_IMPORT, SWAP_CLASS_IN_PYTEST, SWAP_CODE_IN_PYTEST],
    ids=["at import", "class renamed", "from a thread"],
)
def test_grading_under_pytest_runs_the_files_own_tests_and_flags_replaced_ones(solution):
    from whetstone.envs.grading.grade import grade

    task = Task(
        id="pytest/swap",
        source="test",
        kind="synthesis",
        instruction="write solve",
        split="train",
        repo_files={"solution.py": "def solve(x):\n    raise NotImplementedError\n"},
        hidden_tests={"test_h.py": PYTEST_HIDDEN},
        solution_files={"solution.py": SOLVE},
        fail_to_pass=["test_h.py::TestSolve::test_1", "test_h.py::test_2[2]"],
        protected_paths=["test_*.py"],
    )
    honest = grade(task, {"solution.py": SOLVE})
    assert honest.passed and honest.cheat_flags == [], (honest.tests, honest.cheat_flags)
    result = grade(task, {"solution.py": solution})
    assert not result.passed and result.reward == 0.0
    assert any(flag.startswith("test_replaced: test_h.py::") for flag in result.cheat_flags), result.cheat_flags
    assert all(outcome == "failed" for outcome in result.tests.values()), result.tests


def test_under_pytest_decorated_tests_run_as_found_and_failures_keep_their_assert_report():
    from whetstone.envs.grading.grade import grade

    hidden = (
        "import functools\nimport pytest\nfrom solution import solve\n\n\ndef checked(f):\n"
        "    @functools.wraps(f)\n    def wrapper(*args, **kwargs):\n        return f(*args, **kwargs)\n"
        "    return wrapper\n\n\n@checked\ndef test_1():\n    assert solve(1) == 2\n\n\n"
        "class TestMore:\n    @pytest.mark.slow\n    def test_2(self):\n        assert solve(2) == 4\n"
    )
    task = Task(
        id="pytest/decorated",
        source="test",
        kind="synthesis",
        instruction="write solve",
        split="train",
        repo_files={"solution.py": "def solve(x):\n    raise NotImplementedError\n"},
        hidden_tests={"test_h.py": hidden},
        solution_files={"solution.py": SOLVE},
        fail_to_pass=["test_h.py::test_1", "test_h.py::TestMore::test_2"],
        protected_paths=["test_*.py"],
    )
    result = grade(task, {"solution.py": SOLVE})
    assert result.cheat_flags == []  # the wrapper is not the file's code, and is not taken for a replacement
    assert result.tests == {"test_h.py::test_1": "passed", "test_h.py::TestMore::test_2": "failed"}
    assert "assert 3 == 4" in result.log  # the file's own code ran with pytest's assertion rewriting


def test_under_pytest_a_test_defined_twice_runs_its_last_definition_unflagged():
    from whetstone.envs.grading.grade import grade

    hidden = (
        "import pytest\nfrom solution import solve\n\n\nclass TestSolve:\n    def test_1(self):\n"
        "        assert solve(1) == 99\n\n    def test_1(self):  # noqa: F811 (the one pytest collects)\n"
        "        assert solve(1) == 2\n"
    )
    task = Task(
        id="pytest/twice",
        source="test",
        kind="synthesis",
        instruction="write solve",
        split="train",
        repo_files={"solution.py": "def solve(x):\n    raise NotImplementedError\n"},
        hidden_tests={"test_h.py": hidden},
        solution_files={"solution.py": SOLVE},
        fail_to_pass=["test_h.py::TestSolve::test_1"],
        protected_paths=["test_*.py"],
    )
    result = grade(task, {"solution.py": SOLVE})
    assert result.passed and result.cheat_flags == [], (result.tests, result.cheat_flags)
