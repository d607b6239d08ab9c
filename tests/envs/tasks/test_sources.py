"""Loaders that need no sandbox: humaneval, swebench over a local git repository, the registry."""

import errno
import gzip
import json
import os
import subprocess
import tarfile

import pytest

from whetstone.config import load_config
from whetstone.envs.tasks.humaneval import HumanEvalConfig
from whetstone.envs.tasks.humaneval import generate as humaneval_tasks
from whetstone.envs.tasks.patches import apply_patch, patched_paths
from whetstone.envs.tasks.registry import SOURCES, TasksConfig, load_source, load_tasks
from whetstone.envs.tasks.swebench import SwebenchConfig
from whetstone.envs.tasks.swebench import generate as swebench_tasks
from whetstone.errors import WhetstoneError

BUGGY = "def mean(values):\n    return sum(values) / (len(values) + 1)\n"
FIXED = "def mean(values):\n    return sum(values) / len(values)\n"
OLD_TEST = "from calc import mean\n\n\ndef test_one():\n    assert mean([0]) == 0\n"
NEW_TEST = OLD_TEST + "\n\ndef test_two():\n    assert mean([2, 4]) == 3\n"


def test_humaneval_has_164_problems_with_hidden_checks():
    tasks = humaneval_tasks()
    assert len(tasks) == 164 and len({t.id for t in tasks}) == 164
    task = next(t for t in tasks if t.id == "humaneval/0")
    assert task.split == "heldout" and task.kind == "synthesis"
    assert "def has_close_elements" in task.repo_files["solution.py"]
    assert task.solution_files["solution.py"].startswith(task.repo_files["solution.py"])
    [(path, test)] = task.hidden_tests.items()
    assert path == "test_humaneval.py" and "def check(candidate)" in test
    assert task.fail_to_pass == ["test_humaneval.py::test_has_close_elements"]
    assert "check(has_close_elements)" in test


def test_humaneval_limit_and_bad_file(tmp_path):
    assert len(humaneval_tasks(HumanEvalConfig(limit=3))) == 3
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"task_id": "x/1"}\n')
    with pytest.raises(WhetstoneError, match=r"x/1: missing fields"):
        humaneval_tasks(HumanEvalConfig(path=str(bad)))


@pytest.mark.parametrize(
    "name, content, problem",
    [
        ("latin1.jsonl", '{"task_id": "caf\xe9"}\n'.encode("latin-1"), r": 'utf-8' codec can't decode"),
        ("list.jsonl", b'{"task_id": "x/1"}\n\n[1, 2]\n', r": line 3: a JSON list, not an object"),
        ("cut.jsonl.gz", gzip.compress(b'{"task_id": "x/1"}\n' * 50)[:-20], r": Compressed file ended"),
    ],
    ids=["not UTF-8", "not an object", "gzip cut short"],
)
def test_a_humaneval_file_that_cannot_be_read_is_named(tmp_path, name, content, problem):
    (tmp_path / name).write_bytes(content)
    with pytest.raises(WhetstoneError, match=rf"cannot read HumanEval problems from {tmp_path / name}.*{problem}"):
        humaneval_tasks(HumanEvalConfig(path=str(tmp_path / name)))


def _git(repo, *args):
    return subprocess.run(
        ["git", "-c", "user.name=t", "-c", "user.email=t@example.com", *args],
        cwd=repo,
        check=True,
        capture_output=True,
        text=True,
    ).stdout


@pytest.fixture
def swebench_source(tmp_path):
    """A local clone with a bug at the base commit (the fix is committed after it) and its record."""
    return _swebench_source(tmp_path)


def _swebench_source(tmp_path, links=()):
    """`swebench_source`, with symbolic links (path, target) committed in the base commit."""
    repo = tmp_path / "repos" / "acme__calc"
    (repo / "tests").mkdir(parents=True)
    _git(repo, "init", "-q")
    (repo / "calc.py").write_text(BUGGY)
    (repo / "tests" / "test_calc.py").write_text(OLD_TEST)
    for path, target in links:
        (repo / path).parent.mkdir(parents=True, exist_ok=True)
        (repo / path).symlink_to(target)
    _git(repo, "add", ".")
    _git(repo, "commit", "-qm", "base")
    base = _git(repo, "rev-parse", "HEAD").strip()
    (repo / "calc.py").write_text(FIXED)
    patch = _git(repo, "diff")
    (repo / "tests" / "test_calc.py").write_text(NEW_TEST)
    test_patch = _git(repo, "diff", "--", "tests")
    _git(repo, "commit", "-qam", "the fix, later in history")
    record = {
        "instance_id": "acme__calc-1",
        "repo": "acme/calc",
        "base_commit": base,
        "problem_statement": "mean() divides by one too many.",
        "patch": patch,
        "test_patch": test_patch,
        "FAIL_TO_PASS": json.dumps(["tests/test_calc.py::test_two"]),
        "PASS_TO_PASS": ["tests/test_calc.py::test_one"],
        "version": "0.1",
    }
    path = tmp_path / "swebench.jsonl"
    path.write_text(json.dumps(record) + "\n")
    return SwebenchConfig(path=str(path), repos_dir=str(tmp_path / "repos"))


def test_swebench_record_becomes_a_task_at_its_base_commit(swebench_source):
    [task] = swebench_tasks(swebench_source)
    assert task.id == "swebench/acme__calc-1" and task.kind == "bugfix" and task.split == "heldout"
    assert task.repo_files == {"calc.py": BUGGY, "tests/test_calc.py": OLD_TEST}  # no .git, no fix
    assert task.hidden_tests == {"tests/test_calc.py": NEW_TEST}
    assert task.solution_files == {"calc.py": FIXED}
    assert task.fail_to_pass == ["tests/test_calc.py::test_two"] and task.pass_to_pass == [
        "tests/test_calc.py::test_one"
    ]
    assert task.protected_paths == ["tests/test_calc.py"]
    assert task.instruction == "mean() divides by one too many."


def test_swebench_snapshot_dir_keeps_the_tree_on_disk(swebench_source, tmp_path):
    config = swebench_source.model_copy(update={"snapshot_dir": str(tmp_path / "snapshots")})
    [task] = swebench_tasks(config)
    assert task.repo_files == {} and (tmp_path / "snapshots" / "acme__calc-1" / "calc.py").read_text() == BUGGY
    assert not (tmp_path / "snapshots" / "acme__calc-1" / ".git").exists()


def test_swebench_errors_name_the_record(swebench_source, tmp_path):
    path = tmp_path / "bad.jsonl"
    record = json.loads(open(swebench_source.path).read())
    path.write_text(json.dumps({**record, "repo": "acme/missing"}) + "\n")
    with pytest.raises(WhetstoneError, match="'acme/missing' is not cloned"):
        swebench_tasks(swebench_source.model_copy(update={"path": str(path)}))
    path.write_text(
        json.dumps({**record, "patch": record["patch"].replace("len(values) + 1", "len(other) + 1")}) + "\n"
    )
    with pytest.raises(WhetstoneError, match=r"bad.jsonl:1: patch does not apply"):
        swebench_tasks(swebench_source.model_copy(update={"path": str(path)}))
    path.write_text(json.dumps({k: v for k, v in record.items() if k != "test_patch"}) + "\n")
    with pytest.raises(WhetstoneError, match=r"bad.jsonl:1: missing fields \['test_patch'\]"):
        swebench_tasks(swebench_source.model_copy(update={"path": str(path)}))


@pytest.mark.parametrize(
    "field,value,problem",
    [
        ("instance_id", 7, r"fields \['instance_id'\] must be strings"),
        ("instance_id", "../../escaped", "field 'instance_id': id 'swebench/../../escaped' has an empty, '.' or '..'"),
        ("repo", "REPOS/acme__calc", "field 'repo' '.*/repos/acme__calc' must name a repository"),
        ("base_commit", "--output=PWNED", "field 'base_commit' '--output=.*' is not a commit"),
        ("patch", ["--- a/calc.py"], r"fields \['patch'\] must be strings"),
        ("problem_statement", "", "the record makes no valid task: field 'instruction'"),
    ],
)
def test_swebench_record_fields_are_checked_before_use(swebench_source, tmp_path, field, value, problem):
    """A record is data: its id names a folder, its commit is an argument of git."""
    path = tmp_path / "bad.jsonl"
    record = json.loads(open(swebench_source.path).read())
    if isinstance(value, str):  # a file to write and a real clone, named by absolute paths
        value = value.replace("PWNED", str(tmp_path / "pwned")).replace("REPOS", str(tmp_path / "repos"))
    path.write_text(json.dumps({**record, field: value}) + "\n")
    config = swebench_source.model_copy(update={"path": str(path), "snapshot_dir": str(tmp_path / "a" / "snapshots")})
    with pytest.raises(WhetstoneError, match=rf"bad.jsonl:1: {problem}"):
        swebench_tasks(config)
    assert not (tmp_path / "pwned").exists() and not (tmp_path / "escaped").exists()


def test_swebench_snapshot_cut_short_is_not_taken_for_whole(swebench_source, tmp_path, monkeypatch):
    """A disk that fills up while a snapshot is written: the next run writes it again, whole."""
    config = swebench_source.model_copy(update={"snapshot_dir": str(tmp_path / "snapshots")})
    written = []
    makefile = tarfile.TarFile.makefile

    def fill_up(self, member, target):
        if written:
            raise OSError(errno.ENOSPC, "No space left on device")
        written.append(member.name)
        makefile(self, member, target)

    monkeypatch.setattr(tarfile.TarFile, "makefile", fill_up)
    with pytest.raises(OSError, match="No space left"):
        swebench_tasks(config)
    monkeypatch.undo()
    [task] = swebench_tasks(config)
    snapshot = tmp_path / "snapshots" / "acme__calc-1"
    assert task.repo_path == str(snapshot.resolve())
    assert sorted(os.listdir(tmp_path / "snapshots")) == [".acme__calc-1.commit", "acme__calc-1"]
    assert (snapshot / "calc.py").read_text() == BUGGY and (snapshot / "tests" / "test_calc.py").read_text() == OLD_TEST


def test_swebench_snapshot_keeps_links_inside_the_repository(tmp_path):
    config = _swebench_source(tmp_path, links=[("alias.py", "calc.py"), ("pkg/up.py", "../calc.py")])
    [task] = swebench_tasks(config.model_copy(update={"snapshot_dir": str(tmp_path / "snapshots")}))
    snapshot = tmp_path / "snapshots" / "acme__calc-1"
    assert os.readlink(snapshot / "alias.py") == "calc.py" and os.readlink(snapshot / "pkg" / "up.py") == "../calc.py"
    assert (snapshot / "pkg" / "up.py").read_text() == BUGGY and task.solution_files == {"calc.py": FIXED}


def test_swebench_inline_snapshot_refuses_a_link_it_cannot_hold(tmp_path):
    """Inline files are text: a link left out would make a repository that is not the commit's."""
    config = _swebench_source(tmp_path, links=[("alias.py", "calc.py")])
    with pytest.raises(WhetstoneError, match="swebench.jsonl:1: alias.py is a link to calc.py; .* set snapshot_dir"):
        swebench_tasks(config)


@pytest.mark.parametrize(
    "links,named",
    [
        ([("out", "/etc/passwd")], "out -> /etc/passwd"),
        ([("pkg/up", "../../outside")], "pkg/up -> ../../outside"),
        # each alone stays inside; together `a` leads to the snapshot folder's parent
        ([("a", "d/l/.."), ("d/l", "..")], "a -> d/l/.."),
    ],
)
def test_swebench_snapshot_refuses_a_link_out_of_the_repository(tmp_path, links, named):
    """Grading writes changes into a copy of the snapshot on the host: a link out would carry a write out."""
    config = _swebench_source(tmp_path, links=links)
    with pytest.raises(WhetstoneError, match=rf"swebench.jsonl:1: the symbolic link {named} leads out of the repo"):
        swebench_tasks(config.model_copy(update={"snapshot_dir": str(tmp_path / "snapshots")}))
    assert not (tmp_path / "snapshots").exists() or os.listdir(tmp_path / "snapshots") == []


def test_swebench_snapshot_of_another_commit_is_not_reused(swebench_source, tmp_path):
    config = swebench_source.model_copy(update={"snapshot_dir": str(tmp_path / "snapshots")})
    [task] = swebench_tasks(config)
    record = json.loads(open(swebench_source.path).read())
    repo = tmp_path / "repos" / "acme__calc"
    base, later = record["base_commit"], _git(repo, "rev-parse", "HEAD").strip()
    path = tmp_path / "later.jsonl"
    path.write_text(json.dumps({**record, "base_commit": later}) + "\n")
    wrong = f"later.jsonl:1: snapshot .*acme__calc-1 holds commit {base}, but the record's base_commit is {later}: "
    with pytest.raises(WhetstoneError, match=wrong + "remove that folder"):
        swebench_tasks(config.model_copy(update={"path": str(path)}))
    assert (tmp_path / "snapshots" / "acme__calc-1" / "calc.py").read_text() == BUGGY  # left as it was
    path.write_text(json.dumps({**record, "base_commit": base[:12]}) + "\n")  # the same commit, abbreviated
    assert swebench_tasks(config.model_copy(update={"path": str(path)}))[0].repo_path == task.repo_path


def test_swebench_snapshot_without_a_recorded_commit_is_written_again(swebench_source, tmp_path):
    """A folder whose commit is not known (written before commits were recorded) is replaced whole."""
    snapshot = tmp_path / "snapshots" / "acme__calc-1"
    snapshot.mkdir(parents=True)
    (snapshot / "calc.py").write_text(FIXED)
    (snapshot / "stray.py").write_text("")
    [task] = swebench_tasks(swebench_source.model_copy(update={"snapshot_dir": str(tmp_path / "snapshots")}))
    assert sorted(os.listdir(snapshot)) == ["calc.py", "tests"] and (snapshot / "calc.py").read_text() == BUGGY
    assert task.solution_files == {"calc.py": FIXED}
    base = json.loads(open(swebench_source.path).read())["base_commit"]
    assert (tmp_path / "snapshots" / ".acme__calc-1.commit").read_text() == base + "\n"


def test_patches_report_deleted_files():
    patch = (
        "diff --git a/old.py b/old.py\ndeleted file mode 100644\n--- a/old.py\n+++ /dev/null\n@@ -1 +0,0 @@\n-x = 1\n"
    )
    assert patched_paths(patch) == ["old.py"]
    assert apply_patch({"old.py": "x = 1\n", "keep.py": ""}, patch) == {"old.py": None}
    with pytest.raises(WhetstoneError, match="not a unified diff"):
        apply_patch({}, "just words")


def test_patches_name_the_files_git_applies_to():
    """A removed `-- comment` line is no file; empty files and pure renames have no ---/+++ lines;
    git quotes a non-ASCII name; a patch stored without its last newline still applies."""
    sql = "--- a/q.sql\n+++ b/q.sql\n@@ -1,2 +1,2 @@\n--- old\n+-- new\n select 1;\n"
    assert apply_patch({"q.sql": "-- old\nselect 1;\n"}, sql) == {"q.sql": "-- new\nselect 1;\n"}
    assert patched_paths(sql) == ["q.sql"]
    empty = "diff --git a/pkg/__init__.py b/pkg/__init__.py\nnew file mode 100644\nindex 0000000..e69de29\n"
    assert apply_patch({}, empty) == {"pkg/__init__.py": ""}
    gone = "diff --git a/e.py b/e.py\ndeleted file mode 100644\nindex e69de29..0000000\n"
    assert apply_patch({"e.py": "", "a.py": ""}, gone) == {"e.py": None}
    rename = "diff --git a/old.py b/new.py\nsimilarity index 100%\nrename from old.py\nrename to new.py\n"
    assert apply_patch({"old.py": "x = 1\n"}, rename) == {"old.py": None, "new.py": "x = 1\n"}
    assert sorted(patched_paths(rename)) == ["new.py", "old.py"]
    quoted = '--- "a/caf\\303\\251.py"\n+++ "b/caf\\303\\251.py"\n@@ -1 +1 @@\n-x = 1\n+x = 2\n'
    assert apply_patch({"café.py": "x = 1\n"}, quoted) == {"café.py": "x = 2\n"}
    unended = "--- a/a.py\n+++ b/a.py\n@@ -1 +1 @@\n-x = 1\n+x = 2"
    assert apply_patch({"a.py": "x = 1\n"}, unended) == {"a.py": "x = 2\n"}


def test_a_binary_file_in_a_patch_is_applied_and_left_out_of_the_text_returned(tmp_path):
    """SWE-bench patches may carry a binary hunk (`git diff --binary`): its bytes are no text."""
    repo = tmp_path / "repo"
    repo.mkdir()
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-C", str(repo)]
    (repo / "a.py").write_text("a\n")
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "add", "."], check=True)
    subprocess.run([*git, "commit", "-qm", "base"], check=True)
    (repo / "a.py").write_text("b\n")
    (repo / "img.png").write_bytes(b"\x89PNG\r\n\x1a\n\x00\xff\xfe" * 10)
    subprocess.run([*git, "add", "."], check=True)
    patch = subprocess.run([*git, "diff", "--cached", "--binary"], check=True, capture_output=True, text=True).stdout
    assert apply_patch({"a.py": "a\n"}, patch) == {"a.py": "b\n"}
    assert patched_paths(patch) == ["a.py"]


def test_patches_never_read_a_file_outside_the_copy(tmp_path):
    """git writes `+++ /abs/path` inside the copy; a link the patch makes would lead out of it."""
    secret = tmp_path / "secret.txt"
    secret.write_text("TOP SECRET\n")
    absolute = f"--- /dev/null\n+++ {secret}\n@@ -0,0 +1 @@\n+hello\n"
    assert apply_patch({"a.py": ""}, absolute) == {str(secret).lstrip("/"): "hello\n"}
    link = (
        "diff --git a/leak b/leak\nnew file mode 120000\nindex 0000000..1111111\n--- /dev/null\n+++ b/leak\n"
        f"@@ -0,0 +1 @@\n+{secret}\n\\ No newline at end of file\n"
    )
    with pytest.raises(WhetstoneError, match="patch: leak is a symbolic link after patching"):
        apply_patch({"a.py": ""}, link)


def test_patches_keep_line_endings():
    patch = "--- a/a.py\n+++ b/a.py\n@@ -1,2 +1,2 @@\n x = 1\r\n-y = 2\r\n+y = 3\r\n"
    assert apply_patch({"a.py": "x = 1\r\ny = 2\r\n"}, patch) == {"a.py": "x = 1\r\ny = 3\r\n"}


def test_swebench_lines_end_at_newlines_only(swebench_source, tmp_path):
    """U+2028 is a line break to str.splitlines, but plain text inside a JSON string."""
    path = tmp_path / "statement.jsonl"
    record = json.loads(open(swebench_source.path).read())
    path.write_text(json.dumps({**record, "problem_statement": "mean()\u2028is off"}, ensure_ascii=False) + "\n")
    [task] = swebench_tasks(swebench_source.model_copy(update={"path": str(path)}))
    assert task.instruction == "mean()\u2028is off"
    path.write_bytes(b"\xff\n")
    with pytest.raises(WhetstoneError, match=rf"{path}:1: not UTF-8 text"):
        swebench_tasks(swebench_source.model_copy(update={"path": str(path)}))


def test_registry_loads_names_and_files(tmp_path):
    tasks = load_source("synth", ["count=3", "split=heldout"])
    assert [t.id for t in tasks] == [f"synth/heldout/s0-{i:05d}" for i in range(3)]
    path = tmp_path / "tasks.jsonl"
    path.write_text("".join(t.model_dump_json() + "\n" for t in tasks))
    assert load_source(str(path)) == tasks
    with pytest.raises(WhetstoneError, match="unknown task source 'nonsense'"):
        load_source("nonsense")
    with pytest.raises(WhetstoneError, match=r"count"):
        load_source("synth", ["count=-1"])
    with pytest.raises(WhetstoneError, match="overrides apply to generated sources"):
        load_source(str(path), ["count=3"])


def test_tasks_config_section(tmp_path):
    config_file = tmp_path / "tasks.toml"
    config_file.write_text('source = "synth"\n[synth]\ncount = 4\ndifficulty = 3\n')
    config = load_config(TasksConfig, config_file)
    assert len(load_tasks(config)) == 4
    assert set(SOURCES) == {"synth", "repofix", "mutate", "humaneval", "swebench"}
