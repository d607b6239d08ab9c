"""Task sets on disk: JSONL or a folder per task, read back exactly, with errors that say where."""

import json

import pytest
from pydantic import ValidationError

from whetstone.envs.task import Task
from whetstone.envs.tasks.io import read_records, read_tasks, write_tasks
from whetstone.envs.tasks.registry import check_source
from whetstone.envs.tasks.validate import validate_records
from whetstone.errors import WhetstoneError


def _task(task_id: str = "custom/0001") -> Task:
    return Task(
        id=task_id,
        instruction="Fix add() in calc/ops.py.",
        kind="bugfix",
        repo_files={
            "calc/ops.py": "def add(a, b):\n    return a - b\n",
            "tests/test_ops.py": "from calc.ops import add\n",
        },
        hidden_tests={"tests/test_ops.py": "from calc.ops import add\n\ndef test_add():\n    assert add(1, 2) == 3\n"},
        solution_files={"calc/ops.py": "def add(a, b):\n    return a + b\n"},
        fail_to_pass=["tests/test_ops.py::test_add"],
        metadata={"seed": 3},
    )


@pytest.mark.parametrize("name", ["tasks.jsonl", "tasks"])
def test_round_trip(tmp_path, name):
    tasks = [_task("custom/0001"), _task("custom/0002")]
    write_tasks(tasks, tmp_path / name)
    assert read_tasks(tmp_path / name) == tasks


def test_folder_layout_is_plain_files(tmp_path):
    write_tasks([_task()], tmp_path / "out")
    folder = tmp_path / "out" / "custom__0001"
    assert (folder / "repo" / "calc" / "ops.py").read_text() == "def add(a, b):\n    return a - b\n"
    assert (folder / "hidden_tests" / "tests" / "test_ops.py").is_file()
    assert (folder / "solution" / "calc" / "ops.py").is_file()
    record = json.loads((folder / "task.json").read_text())
    assert record["id"] == "custom/0001" and "repo_files" not in record
    assert read_tasks(folder) == [_task()]  # a single task folder reads too


def test_jsonl_errors_name_file_line_and_field(tmp_path):
    good = _task().model_dump_json()
    bad_field = json.dumps({**json.loads(good), "id": "custom/0002", "kind": "refactor"})
    path = tmp_path / "tasks.jsonl"
    path.write_text(good + "\n\n{not json\n" + bad_field + "\n" + good + "\n")
    records = list(read_records(path))
    assert [r.where for r in records] == [f"{path}:1", f"{path}:3", f"{path}:4", f"{path}:5"]
    assert records[0].task is not None
    assert "not valid JSON" in records[1].problem
    assert "field 'kind'" in records[2].problem
    assert "duplicate task id 'custom/0001'" in records[3].problem and f"{path}:1" in records[3].problem
    with pytest.raises(WhetstoneError, match=rf"{path}:3: not valid JSON"):
        read_tasks(path)


def test_missing_required_field_is_named(tmp_path):
    path = tmp_path / "tasks.jsonl"
    path.write_text(json.dumps({"id": "x", "hidden_tests": {"test_a.py": ""}}) + "\n")
    with pytest.raises(WhetstoneError, match=r"tasks.jsonl:1: field 'instruction': Field required"):
        read_tasks(path)


@pytest.mark.parametrize(
    "field,value", [("test_time_limit_s", "Infinity"), ("time_limit_s", "1e999"), ("metadata", '{"seed": NaN}')]
)
def test_numbers_json_cannot_hold_are_refused_named(tmp_path, field, value):
    """Python's JSON reader takes NaN and Infinity; a task holding one would be written back as
    null and could not be read again."""
    path = tmp_path / "tasks.jsonl"
    path.write_text(_task().model_dump_json()[:-1] + f', "{field}": {value}}}\n')
    [record] = read_records(path)
    assert record.task is None and f"field '{field}" in record.problem and "finite number" in record.problem


def test_unsafe_paths_are_rejected(tmp_path):
    path = tmp_path / "tasks.jsonl"
    record = {**json.loads(_task().model_dump_json()), "solution_files": {"../escape.py": ""}}
    path.write_text(json.dumps(record) + "\n")
    with pytest.raises(WhetstoneError, match="solution_files: path '../escape.py' must be relative"):
        read_tasks(path)


@pytest.mark.parametrize(
    ("field", "key", "problem"),
    [
        ("repo_files", "./calc/ops.py", "is not normalized (write 'calc/ops.py')"),
        ("repo_files", "tests//test_ops.py", "is not normalized (write 'tests/test_ops.py')"),
        ("hidden_tests", "tests/test_ops.py/", "is not normalized (write 'tests/test_ops.py')"),
        ("solution_files", "calc/./ops.py", "is not normalized (write 'calc/ops.py')"),
        ("solution_files", ".", "names no file"),
    ],
)
def test_paths_must_be_written_as_the_workspace_reads_them(tmp_path, field, key, problem):
    """A workspace reads `./calc/ops.py` back as `calc/ops.py`: the key would look deleted."""
    path = tmp_path / "tasks.jsonl"
    record = json.loads(_task().model_dump_json())
    record[field] = {**record[field], key: ""}
    path.write_text(json.dumps(record) + "\n")
    with pytest.raises(WhetstoneError) as err:
        read_tasks(path)
    assert f"task 'custom/0001': {field}: path {key!r} {problem}" in str(err.value)


@pytest.mark.parametrize(
    ("key", "text", "part"), [("calc/ops.py", "x = '\\ud83d'", "text"), ("\\ud83d.py", "", "path")]
)
def test_a_file_no_file_system_can_hold_is_refused_naming_it(tmp_path, key, text, part):
    """JSON escapes a lone surrogate (half of an emoji a scraper cut): no file can hold it, and
    the sandbox would fail to write the task's every rollout."""
    path = tmp_path / "tasks.jsonl"
    record = json.loads(_task().model_dump_json())
    path.write_text(json.dumps(record)[:-1] + f', "solution_files": {{"{key}": "{text}"}}}}' + "\n")
    with pytest.raises(WhetstoneError, match=f"solution_files: the {part} of .* holds a character no file can hold"):
        read_tasks(path)


def test_a_path_cannot_be_a_file_and_a_directory():
    task = json.loads(_task().model_dump_json())
    with pytest.raises(ValidationError, match="repo_files: 'calc' is a file, but 'calc/ops.py' needs it to be a dir"):
        Task.model_validate({**task, "repo_files": {**task["repo_files"], "calc": ""}})
    with pytest.raises(
        ValidationError, match=r"'tests/test_ops.py' \(in repo_files\) is a file, but 'tests/test_ops.py/x"
    ):
        Task.model_validate({**task, "hidden_tests": {"tests/test_ops.py/x.py": ""}})
    with pytest.raises(ValidationError, match=r"solution_files: 'calc' is a file, but 'calc/ops.py' \(in repo_files\)"):
        Task.model_validate({**task, "solution_files": {"calc": ""}})
    Task.model_validate({**task, "solution_files": task["repo_files"]})  # the same path in two maps is fine


def test_folder_layout_keeps_line_endings(tmp_path):
    crlf = _task().model_copy(
        update={
            "repo_files": {"calc/ops.py": "def add(a, b):\r\n    return a - b\r\n", "data.txt": "a\rb\r\nc\n"},
            "hidden_tests": {"tests/test_ops.py": "def test_add():\r\n    assert True\r\n"},
            "solution_files": {"calc/ops.py": "def add(a, b):\r\n    return a + b\r\n"},
        }
    )
    write_tasks([crlf], tmp_path / "out")
    folder = tmp_path / "out" / "custom__0001"
    assert (folder / "repo" / "data.txt").read_bytes() == b"a\rb\r\nc\n"
    assert read_tasks(tmp_path / "out") == [crlf]


def test_files_that_are_not_utf8_are_named(tmp_path):
    write_tasks([_task()], tmp_path / "out")
    folder = tmp_path / "out" / "custom__0001"
    (folder / "task.json").write_bytes((folder / "task.json").read_bytes().replace(b"Fix", b"\xffFix"))
    with pytest.raises(WhetstoneError, match=rf"{folder / 'task.json'}: not UTF-8 text"):
        read_tasks(tmp_path / "out")
    path = tmp_path / "tasks.jsonl"
    path.write_bytes(b'{"id": "\xff"}\n' + _task().model_dump_json().encode() + b"\n")
    bad, good = read_records(path)
    assert bad.where == f"{path}:1" and bad.problem.startswith("not UTF-8 text") and good.task == _task()


def test_folder_field_given_twice_is_an_error(tmp_path):
    write_tasks([_task()], tmp_path / "out")
    task_json = tmp_path / "out" / "custom__0001" / "task.json"
    task_json.write_text(json.dumps({**json.loads(task_json.read_text()), "repo_files": {}}))
    with pytest.raises(WhetstoneError, match="'repo_files' given both in task.json and as repo/"):
        read_tasks(tmp_path / "out")


def test_missing_source_and_empty_folder(tmp_path):
    with pytest.raises(WhetstoneError, match=f"no such file: {tmp_path / 'nope.jsonl'}"):
        read_tasks(tmp_path / "nope.jsonl")
    with pytest.raises(WhetstoneError, match="no task folders"):
        read_tasks(tmp_path)


def test_failed_write_leaves_the_old_file(tmp_path):
    path = tmp_path / "tasks.jsonl"
    write_tasks([_task()], path)
    before = path.read_text()

    def tasks_then_crash():
        yield _task("custom/0002")
        raise RuntimeError("generator died")

    with pytest.raises(RuntimeError):
        write_tasks(tasks_then_crash(), path)
    assert path.read_text() == before
    assert [p.name for p in tmp_path.iterdir()] == ["tasks.jsonl"]  # no temporary left behind


def _folder_set(tmp_path):
    write_tasks([_task()], tmp_path / "out")
    return tmp_path / "out", tmp_path / "out" / "custom__0001"


def test_a_symbolic_link_out_of_the_task_folder_is_refused_named(tmp_path):
    """An untrusted task must not carry a file of the machine (~/.aws/credentials) into its repo_files."""
    secret = tmp_path / "secret.txt"
    secret.write_text("password\n")
    root, folder = _folder_set(tmp_path)
    (folder / "repo" / "leak.py").symlink_to(secret)
    [record] = read_records(root)
    assert record.task is None
    assert f"{folder / 'repo' / 'leak.py'} is a symbolic link to {secret}, outside the task folder" in record.problem
    (folder / "repo" / "leak.py").unlink()
    (folder / "hidden_tests" / "data").symlink_to(tmp_path, target_is_directory=True)  # a folder out, too
    with pytest.raises(WhetstoneError, match=f"{folder / 'hidden_tests' / 'data'} is a symbolic link to {tmp_path},"):
        read_tasks(root)


@pytest.mark.parametrize("link", ["task.json", "repo", "solution"])
def test_task_json_and_the_file_folders_cannot_be_links_out_of_the_task_folder(tmp_path, link):
    root, folder = _folder_set(tmp_path)
    outside = tmp_path / f"outside-{link}"
    (folder / link).rename(outside)
    (folder / link).symlink_to(outside)
    with pytest.raises(WhetstoneError, match=f"{folder / link} is a symbolic link to {outside}, outside the task"):
        read_tasks(root)


def test_a_task_folder_that_links_out_of_the_task_set_is_refused_named(tmp_path):
    """A task folder that is a link takes the folder it points to as the task's: anywhere on the
    machine, if it may point out of the set. One pointing inside the set is read."""
    root, folder = _folder_set(tmp_path)
    outside = tmp_path / "elsewhere"
    folder.rename(outside)
    folder.symlink_to(outside, target_is_directory=True)
    [record] = read_records(root)
    assert record.task is None and record.where == str(folder / "task.json")
    assert record.problem == (
        f"{folder} is a symbolic link to {outside}, outside the task set {root}: refused "
        "(a task reads only its own files; copy the folder in)"
    )
    folder.unlink()
    (root / "kept").mkdir()
    outside.rename(root / "kept" / "custom__0001")
    folder.symlink_to(root / "kept" / "custom__0001", target_is_directory=True)
    assert read_tasks(root) == [_task()]
    assert read_tasks(folder) == [_task()]  # a task folder given on its own is read wherever it points


def test_a_broken_link_and_a_link_to_a_folder_are_named_and_a_link_inside_is_read(tmp_path):
    root, folder = _folder_set(tmp_path)
    (folder / "repo" / "gone.py").symlink_to("nothere.py")
    with pytest.raises(
        WhetstoneError, match=f"{folder / 'repo' / 'gone.py'} is a broken symbolic link \\(to nothere.py\\)"
    ):
        read_tasks(root)
    (folder / "repo" / "gone.py").unlink()
    (folder / "repo" / "lib").symlink_to("calc", target_is_directory=True)
    with pytest.raises(WhetstoneError, match=f"{folder / 'repo' / 'lib'} is a symbolic link to the folder"):
        read_tasks(root)
    (folder / "repo" / "lib").unlink()
    (folder / "repo" / "calc" / "same.py").symlink_to("ops.py")  # inside the task folder: read as a copy
    [task] = read_tasks(root)
    assert task.repo_files["calc/same.py"] == task.repo_files["calc/ops.py"]


@pytest.mark.parametrize(
    ("task_id", "problem"),
    [
        ("..", "has an empty, '.' or '..' part"),
        ("a/../../x", "has an empty, '.' or '..' part"),
        ("/abs", "has an empty, '.' or '..' part"),
        ("a//b", "has an empty, '.' or '..' part"),
        (".", "has an empty, '.' or '..' part"),
        ("a\nb", "holds the control character '\\n'"),
        ("a\x00b", "holds the control character '\\x00'"),
        ("x" * 300, "is longer than a folder name can be"),
        ("   ", "is blank (it names the task and its folder: write e.g. 'source/name')"),
        ("", "is blank"),
        ("a/  /b", "has an empty, '.' or '..' part"),
    ],
)
def test_an_id_that_cannot_name_a_folder_is_refused_naming_the_line(tmp_path, task_id, problem):
    path = tmp_path / "tasks.jsonl"
    bad = json.dumps({**json.loads(_task().model_dump_json()), "id": task_id})
    path.write_text(_task("custom/ok").model_dump_json() + "\n" + bad + "\n")
    good, refused = read_records(path)
    assert good.task is not None and refused.task is None and refused.id == task_id
    assert refused.where == f"{path}:2" and refused.problem.startswith("field 'id': id ")
    assert problem in refused.problem
    with pytest.raises(WhetstoneError, match=f"{path}:2: field 'id'"):
        read_tasks(path)


def test_a_blank_task_id_is_refused_wherever_the_task_is_made():
    with pytest.raises(ValidationError, match=r"id ' \\t' is blank: give the task an id"):
        _task(" \t")


def test_a_task_with_an_unsafe_id_is_not_written_as_a_folder(tmp_path):
    with pytest.raises(WhetstoneError, match=r"task '\.\.': id '\.\.' has an empty, '\.' or '\.\.' part"):
        write_tasks([_task("..")], tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_task_source_path_has_home_and_variables_expanded(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("TASKS", str(tmp_path / "sets"))
    monkeypatch.chdir(tmp_path)
    write_tasks([_task()], "~/sets/tasks.jsonl")
    assert read_tasks("$TASKS/tasks.jsonl") == read_tasks(tmp_path / "sets" / "tasks.jsonl") == [_task()]
    check_source("~/sets/tasks.jsonl")  # what `whetstone run` asks before its first stage
    validate_records([], cache_path="~/sets/cache.json")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["sets"]
    assert sorted(p.name for p in (tmp_path / "sets").iterdir()) == ["cache.json", "tasks.jsonl"]
