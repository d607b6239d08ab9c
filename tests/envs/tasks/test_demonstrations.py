"""Demonstrations: the harness's own prompt, tools and tool results, short enough for a tiny model."""

import json

import pytest

from tests.envs.harness.harness_support import tokenizer
from whetstone.envs import prompts
from whetstone.envs.task import Task
from whetstone.envs.tasks.demonstrations import demonstration, demonstrations, failed_attempt
from whetstone.envs.tasks.synth import SynthConfig, generate
from whetstone.errors import WhetstoneError
from whetstone.tokenizer import encode_chat


def _calls(messages):
    return [
        (m["tool_calls"][0]["function"]["name"], json.loads(m["tool_calls"][0]["function"]["arguments"]))
        for m in messages
        if m["role"] == "assistant"
    ]


def test_synth_demonstration_writes_tests_and_submits():
    task = generate(SynthConfig(count=1))[0]
    messages = demonstration(task)
    assert messages[0] == {"role": "system", "content": prompts.SYSTEM_PROMPT}
    assert messages[1] == {"role": "user", "content": task.instruction + "\nFiles: test_solution.py"}
    assert _calls(messages) == [
        ("write_file", {"path": "solution.py", "content": task.solution_files["solution.py"]}),
        ("run_tests", {}),
        ("submit", {}),
    ]
    tool_turns = [m for m in messages if m["role"] == "tool"]
    assert [m["tool_call_id"] for m in tool_turns] == ["call_1", "call_2"]
    assert tool_turns[0]["content"] == f"wrote solution.py ({task.solution_files['solution.py'].count(chr(10))} lines)"
    assert tool_turns[1]["content"] == "3 passed"  # the visible tests only: hidden ones are never shown


def test_every_call_uses_a_declared_tool_with_its_parameters():
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in prompts.TOOLS}
    for messages in demonstrations(generate(SynthConfig(count=20, difficulty=3))):
        for name, arguments in _calls(messages):
            assert set(arguments) == set(schemas[name]["required"])


def test_bugfix_demonstration_reads_then_edits_uniquely():
    original = "def f(x):\n    return x\n\n\ndef g(x):\n    return x - 1\n"
    fixed = "def f(x):\n    return x\n\n\ndef g(x):\n    return x + 1\n"
    task = Task(
        id="t",
        kind="bugfix",
        instruction="g(1) should be 2.",
        repo_files={"m.py": original, "test_m.py": ""},
        visible_tests=["test_m.py"],
        hidden_tests={"test_m.py": ""},
        solution_files={"m.py": fixed},
        fail_to_pass=["test_m.py::test_g"],
        pass_to_pass=["test_m.py::test_f"],
    )
    messages = demonstration(task)
    (read, read_args), (edit, edit_args), (run, _), (submit, _) = _calls(messages)
    assert (read, edit, run, submit) == ("read_file", "edit", "run_tests", "submit")
    assert messages[3]["content"] == original  # read_file shows the file
    assert original.count(edit_args["old"]) == 1
    assert original.replace(edit_args["old"], edit_args["new"]) == fixed
    assert messages[-2]["content"] == "2 passed"


@pytest.mark.parametrize(
    "visible, shown",
    [
        (["tests"], "3 passed"),  # a directory holding the test files
        (["tests/"], "3 passed"),
        (["tests/test_m.py"], "2 passed"),
        (["tests/test_m.py::test_g"], "1 passed"),  # a node id: that test (and its parameters)
        (["tests/test_m.py::TestH"], "1 passed"),  # a class's node id: its tests
        (["tests/test_m"], "no tests ran"),  # a path prefix is not a directory
    ],
)
def test_run_tests_in_a_demonstration_counts_the_graded_tests_its_visible_tests_run(visible, shown):
    files = {"m.py": "def g(x):\n    return x - 1\n", "tests/test_m.py": "", "tests/test_n.py": "", "tests/test_m": ""}
    task = Task(
        id="t",
        kind="bugfix",
        instruction="g(1) should be 2.",
        repo_files=files,
        visible_tests=visible,
        hidden_tests={"tests/test_m.py": "", "tests/test_n.py": ""},
        solution_files={"m.py": "def g(x):\n    return x + 1\n"},
        fail_to_pass=["tests/test_m.py::test_g[1]"],
        pass_to_pass=["tests/test_m.py::TestH::test_h", "tests/test_n.py::test_n"],
    )
    assert demonstration(task)[-2]["content"] == shown


def _edit_of(original: str, fixed: str) -> dict:
    """The arguments of the `edit` call in the demonstration of a one-file fix."""
    task = Task(
        id="t",
        kind="bugfix",
        instruction="x",
        repo_files={"m.py": original},
        hidden_tests={"test_m.py": ""},
        solution_files={"m.py": fixed},
        fail_to_pass=["test_m.py::t"],
    )
    return _calls(demonstration(task))[1][1]


def test_ambiguous_line_gets_context_until_unique():
    original = "a = 1\nb = 0\na = 1\nc = 0\n"
    fixed = "a = 1\nb = 0\na = 2\nc = 0\n"
    edit_args = _edit_of(original, fixed)
    assert original.count(edit_args["old"]) == 1 and original.replace(edit_args["old"], edit_args["new"]) == fixed


def test_an_edit_among_repeated_lines_changes_the_right_one():
    """`0,0,0` occurs once counted without overlap, yet starts at two lines: the edit tool would
    change the first, not the line the fix changes."""
    original = "TABLE = [\n    0,\n    0,\n    0,\n    0,\n]\n"
    fixed = "TABLE = [\n    0,\n    0,\n    1,\n    0,\n]\n"
    edit_args = _edit_of(original, fixed)
    assert original.count(edit_args["old"]) == 1  # what the edit tool checks
    assert original.replace(edit_args["old"], edit_args["new"], 1) == fixed  # what it then writes


def test_heldout_tasks_are_refused():
    task = generate(SynthConfig(count=1, split="heldout"))[0]
    with pytest.raises(WhetstoneError, match="train split only"):
        demonstrations([task])


def test_system_prompt_lists_every_tool():
    for tool in prompts.TOOLS:
        assert f"\n{tool['function']['name']}(" in prompts.SYSTEM_PROMPT
    assert len(prompts.SYSTEM_PROMPT) < 600


def test_run_tests_result_text():
    assert prompts.run_tests_result({"a::t1": "passed", "a::t2": "failed"}) == "FAILED a::t2\n1 passed, 1 failed"
    assert prompts.run_tests_result({}) == "no tests ran"


def test_easy_demonstrations_fit_in_512_tokens():
    """With a 4096-token BPE trained on standard-library code, as in the embedded default."""
    import sysconfig
    from pathlib import Path

    from whetstone.tokenizer import Tokenizer, encode_chat

    library = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[:80]
    tokenizer = Tokenizer.train([path.read_text(errors="ignore") for path in library], vocab_size=4096)
    easy = generate(SynthConfig(count=40, difficulty=2))
    assert max(len(encode_chat(tokenizer, messages).ids) for messages in demonstrations(easy)) <= 512


def test_a_recovery_demonstration_shows_a_masked_slip_its_real_test_output_then_the_fix():
    task = next(t for t in generate(SynthConfig(count=50, seed=2)) if "x = x + " in t.solution_files["solution.py"])
    attempt = failed_attempt(task, max_chars=2048)  # e.g. x + 3 -> x + 4 or x - 3
    reference = task.solution_files["solution.py"]
    assert attempt.content != reference and attempt.path == "solution.py"
    assert attempt.test_output.startswith("FAILED test_solution.py::") and "[exit code 1]" in attempt.test_output
    messages = demonstration(task, attempt)
    assert _calls(messages) == [
        ("write_file", {"path": "solution.py", "content": attempt.content}),
        ("run_tests", {}),
        ("write_file", {"path": "solution.py", "content": reference}),
        ("run_tests", {}),
        ("submit", {}),
    ]
    assert [m.get("weight", 1) for m in messages if m["role"] == "assistant"] == [0, 1, 1, 1, 1]
    assert messages[5]["content"] == attempt.test_output and messages[-2]["content"] == "3 passed"
    assert [m["tool_call_id"] for m in messages if m["role"] == "tool"] == ["call_1", "call_2", "call_3", "call_4"]
    encoded = encode_chat(tokenizer(), messages)
    trained = tokenizer().decode([i for i, m in zip(encoded.ids, encoded.assistant_mask) if m])
    assert json.dumps(reference)[1:-1] in trained and json.dumps(attempt.content)[1:-1] not in trained


def test_recovery_demonstrations_are_a_stable_share_of_tasks():
    tasks = generate(SynthConfig(count=12, seed=4))
    assert all(len(m) == 7 for m in demonstrations(tasks))  # none: no sandbox is started
    first, again = demonstrations(tasks, recovery_fraction=0.5), demonstrations(tasks, recovery_fraction=0.5)
    assert first == again and 0 < sum(len(m) > 7 for m in first) < len(tasks)


def test_a_misread_attempt_is_another_tasks_solution_for_the_same_input_type_that_fails():
    tasks = generate(SynthConfig(count=30, seed=3))
    task = tasks[0]
    attempt = failed_attempt(task, max_chars=2048, kind="misread", peers=tasks)
    peers_solutions = {
        t.solution_files["solution.py"] for t in tasks[1:] if t.metadata["input_type"] == task.metadata["input_type"]
    }
    assert attempt.content in peers_solutions and attempt.content != task.solution_files["solution.py"]
    assert attempt.test_output.startswith(("FAILED", "ERROR")) and "[exit code" in attempt.test_output
    assert failed_attempt(task, max_chars=2048, kind="misread", peers=[task]) is None  # no other task to misread
    transcripts = demonstrations(tasks[:8], recovery_fraction=1.0, attempt="misread")
    solutions = {t.solution_files["solution.py"] for t in tasks[:8]}
    opened = [
        (_calls(m)[0][1]["content"], t.solution_files["solution.py"]) for t, m in zip(tasks, transcripts) if len(m) > 7
    ]
    assert len(opened) >= 4 and all(wrong in solutions and wrong != right for wrong, right in opened)
