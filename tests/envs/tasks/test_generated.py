"""Generated bug-fix sources end to end: bugs injected, tests run in sandboxes, tasks that validate."""

import pytest

from whetstone.envs.tasks.mutate import MutateConfig, mutate_project, read_project, stdlib_project
from whetstone.envs.tasks.repofix import RepofixConfig
from whetstone.envs.tasks.repofix import generate as repofix_tasks
from whetstone.envs.tasks.validate import check_task, validate_tasks
from whetstone.errors import WhetstoneError

PROJECT = {
    "calc.py": "def double(x):\n    return x * 2\n",
    "names.py": "def greet(name):\n    return 'hi ' + name\n",
    "tests/test_calc.py": "from calc import double\nfrom names import greet\n\n\n"
    "def test_double():\n    assert double(5) == 10\n\n\ndef test_greet():\n    assert greet('ada') == 'hi ada'\n",
}


def test_mutate_keeps_a_mutant_that_breaks_a_passing_test_and_it_validates():
    config = MutateConfig(sources=["calc.py"], count=1, max_tries=2)  # calc.py:double is in the train split
    [task] = mutate_project(PROJECT, "calc", config)
    assert task.id == "mutate/calc/train/s0-0000" and task.kind == "bugfix" and task.split == "train"
    assert task.fail_to_pass == ["tests/test_calc.py::test_double"]
    assert task.pass_to_pass == ["tests/test_calc.py::test_greet"]
    assert task.repo_files["calc.py"] != PROJECT["calc.py"] and task.solution_files == {"calc.py": PROJECT["calc.py"]}
    assert task.hidden_tests == {"tests/test_calc.py": PROJECT["tests/test_calc.py"]}
    assert task.protected_paths == ["tests/test_calc.py"] and task.visible_tests == ["tests/test_calc.py"]
    assert task.instruction.startswith("These tests fail: tests/test_calc.py::test_double (test_double: `assert ")
    assert check_task(task) is None


def test_a_source_file_that_does_not_parse_is_left_out_and_named(capsys):
    """A Python 2 script or a fixture meant not to parse holds no mutation sites; the rest still does."""
    project = {**PROJECT, "examples/py2.py": "print 'hello'\n"}
    [task] = mutate_project(project, "calc", MutateConfig(sources=["calc.py", "examples/*"], count=1, max_tries=2))
    assert task.fail_to_pass == ["tests/test_calc.py::test_double"]
    assert (
        "left out 1 files that do not parse as Python: examples/py2.py (Missing parentheses" in capsys.readouterr().err
    )


def test_mutate_needs_source_and_tests():
    with pytest.raises(WhetstoneError, match="found 1 source and 0 test files"):
        mutate_project({"calc.py": PROJECT["calc.py"]}, "calc", MutateConfig())


def test_mutate_refuses_a_split_no_function_of_the_project_is_in():
    """calc.py:double is a train function: no held-out bug can go into it (refused before any test run)."""
    config = MutateConfig(sources=["calc.py"], split="heldout")
    with pytest.raises(WhetstoneError) as refused:
        mutate_project(PROJECT, "calc", config)
    assert str(refused.value).startswith(
        "mutate: calc: no function of its source files (calc.py) that a bug can go into is in the 'heldout' split"
    )


def test_a_project_is_read_as_written_and_links_out_of_it_are_refused(tmp_path):
    """CRLF endings stay (a test may compare a data file's bytes); a link out would carry a host file."""
    project = tmp_path / "project"
    project.mkdir()
    (project / "calc.py").write_bytes(b"def double(x):\r\n    return x * 2\r\n")
    (project / "data.csv").write_bytes(b"a,b\r\n1,2\r")
    (project / "alias.py").symlink_to("calc.py")
    assert read_project(project) == {
        "alias.py": "def double(x):\r\n    return x * 2\r\n",
        "calc.py": "def double(x):\r\n    return x * 2\r\n",
        "data.csv": "a,b\r\n1,2\r",
    }
    (tmp_path / "secret.txt").write_text("TOP SECRET")
    (project / "notes.txt").symlink_to(tmp_path / "secret.txt")
    with pytest.raises(WhetstoneError, match=r"notes.txt is a symbolic link to .*secret.txt, outside the project"):
        read_project(project)


@pytest.mark.slow
def test_mutate_standard_library_with_cpython_tests():
    """heapq.py with CPython's own Lib/test/test_heapq.py (skipped where the test package is absent)."""
    try:
        files = stdlib_project("heapq")
    except Exception as err:
        pytest.skip(str(err))
    tasks = mutate_project(files, "heapq", MutateConfig(count=2, max_tries=10))
    assert len(tasks) == 2
    for task in tasks:
        assert task.fail_to_pass and all(t.startswith("test_heapq.py::") for t in task.fail_to_pass + task.pass_to_pass)
    report = validate_tasks(tasks)
    assert report.invalid == []


@pytest.mark.slow
def test_repofix_tasks_validate():
    tasks = repofix_tasks(RepofixConfig(count=3))
    assert {t.metadata["template"] for t in tasks} <= {"shop", "textkit", "life"}
    for task in tasks:
        assert task.kind == "bugfix" and task.instruction.startswith("Bug in the `")
        assert len(task.repo_files) >= 4 and task.fail_to_pass
    assert validate_tasks(tasks).invalid == []


@pytest.mark.slow
def test_mutants_that_hang_are_dropped():
    """`n -= 1` -> `n += 1` never ends; such a mutant would cost every grading its whole time limit."""
    project = {
        "count.py": "def countdown(n):\n    while n > 0:\n        n -= 1\n    return n\n",
        "test_count.py": "from count import countdown\n\n\ndef test_countdown():\n    assert countdown(5) == 0\n",
    }
    config = MutateConfig(count=20, max_tries=20, split="heldout")  # count.py:countdown is held out
    kept = {task.metadata["mutation"] for task in mutate_project(project, "count", config)}
    hanging = {"binop at line 3: ' -= ' -> ' += '", "off_by_one at line 3: '1' -> '0'"}
    assert len(kept) == 5 and kept.isdisjoint(hanging)


def test_mutate_with_a_custom_test_command_probes_the_project_with_it():
    """The probe runs every test: it lists no ids, which a loaded task with a custom command must.
    The command runs the whole suite and leaves the ids a task's grading appends unused."""
    command = (
        'python -c \'import os, sys, pytest; sys.exit(pytest.main(["-p", "no:cacheprovider", '
        '"--junitxml=" + os.environ["WHETSTONE_JUNIT_XML"]]))\''
    )
    config = MutateConfig(sources=["calc.py"], count=1, max_tries=2, test_command=command)
    [task] = mutate_project(PROJECT, "calc", config)
    assert task.test_command == command and task.fail_to_pass == ["tests.test_calc::test_double"]
    assert check_task(task) is None


def test_mutate_refuses_a_custom_test_command_that_cannot_run_the_ids_its_tasks_give_it():
    """pytest under another name takes the appended ids (`tests.test_calc::test_double`, its JUnit
    report's) for paths, finds none and exits 4: none of the tasks would validate."""
    command = (
        "python -c 'import sys, pytest; sys.exit(pytest.main())' -p no:cacheprovider --junitxml=$WHETSTONE_JUNIT_XML"
    )
    config = MutateConfig(sources=["calc.py"], count=1, max_tries=2, test_command=command)
    with pytest.raises(WhetstoneError) as refused:
        mutate_project(PROJECT, "calc", config)
    message = str(refused.value)
    assert "passes the project's tests when given their files, but not when given their ids" in message
    assert "tests.test_calc::test_double, tests.test_calc::test_greet did not pass" in message
    assert "file or directory not found: tests.test_calc::test_double" in message
