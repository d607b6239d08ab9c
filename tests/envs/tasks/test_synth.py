"""synth: deterministic, compositional, disjoint splits, and tests that catch wrong solutions."""

import collections

import pytest

from whetstone.envs.tasks.synth import Program, SynthConfig, generate, run_source
from whetstone.envs.tasks.synth_ops import OPS


def _cases(test_file: str) -> list[tuple[object, object]]:
    """(input, expected) of each `assert solve(x) == y` line of a generated test file."""
    cases = []
    for line in test_file.splitlines():
        if line.strip().startswith("assert solve("):
            call, expected = line.strip()[len("assert ") :].split(" == ")
            cases.append((eval(call[len("solve(") : -1]), eval(expected)))
    return cases


def test_same_config_gives_same_tasks_and_seed_changes_them():
    a, b = generate(SynthConfig(count=20)), generate(SynthConfig(count=20))
    assert [t.model_dump() for t in a] == [t.model_dump() for t in b]
    c = generate(SynthConfig(count=20, seed=1))
    assert [t.instruction for t in a] != [t.instruction for t in c]


def test_task_shape():
    task = generate(SynthConfig(count=1, difficulty=3))[0]
    assert task.kind == "synthesis" and task.source == "synth" and task.split == "train"
    assert task.id == "synth/train/s0-00000"
    assert set(task.repo_files) == {"test_solution.py"} and task.visible_tests == ["test_solution.py"]
    assert set(task.hidden_tests) == {"test_hidden.py"} and set(task.solution_files) == {"solution.py"}
    assert len(task.fail_to_pass) == 3 + 5
    assert task.instruction.startswith("Write solve(x) in solution.py.")


def test_reference_solution_produces_every_expected_output():
    for task in generate(SynthConfig(count=50, difficulty=3)):
        cases = _cases(task.repo_files["test_solution.py"]) + _cases(task.hidden_tests["test_hidden.py"])
        inputs = [value for value, _ in cases]
        assert run_source(task.solution_files["solution.py"], inputs) == [out for _, out in cases]


def test_hidden_inputs_differ_from_visible_ones():
    for task in generate(SynthConfig(count=50, difficulty=3)):
        visible = {repr(v) for v, _ in _cases(task.repo_files["test_solution.py"])}
        hidden = {repr(v) for v, _ in _cases(task.hidden_tests["test_hidden.py"])}
        assert visible.isdisjoint(hidden)


def test_every_step_is_checked_by_the_tests():
    """Dropping any one step of the solution fails at least one test (the steps cannot be skipped)."""
    for task in generate(SynthConfig(count=40, difficulty=3)):
        source = task.solution_files["solution.py"].splitlines()
        cases = _cases(task.repo_files["test_solution.py"]) + _cases(task.hidden_tests["test_hidden.py"])
        for i in range(1, len(source) - 1):
            if source[i].lstrip().startswith("#"):
                continue  # a step's comment: dropping it changes nothing
            without = "\n".join(source[:i] + source[i + 1 :])
            try:
                outputs = run_source(without, [v for v, _ in cases])
            except Exception:
                continue
            assert outputs != [out for _, out in cases], (task.id, i)


def test_difficulty_is_the_number_of_steps():
    tasks = generate(SynthConfig(count=90, difficulty=3))
    counts = collections.Counter(task.difficulty for task in tasks)
    assert set(counts) == {1, 2, 3} and min(counts.values()) > 15
    for task in tasks:
        assert task.solution_files["solution.py"].count("\n    x = ") == task.difficulty
        assert task.instruction.count(", then ") == task.difficulty - 1
    assert {t.difficulty for t in generate(SynthConfig(count=10, difficulty=4, min_difficulty=4))} == {4}


def test_heldout_compositions_never_appear_in_train():
    train = generate(SynthConfig(count=600, difficulty=3))
    heldout = generate(SynthConfig(count=200, difficulty=3, split="heldout", seed=7))

    code = {op.name: op.code for op in OPS}

    def content(task):  # the solution; for multi-step tasks its code templates (constants left out)
        if task.difficulty == 1:
            return task.solution_files["solution.py"]
        return "|".join(code[name] for name in task.metadata["ops"].split("|"))

    assert {content(t) for t in train}.isdisjoint({content(t) for t in heldout})
    assert all(t.split == "heldout" and t.id.startswith("synth/heldout/") for t in heldout)
    # ... but held-out tasks only combine primitives that train tasks teach
    train_ops = {op for t in train for op in t.metadata["ops"].split("|")}
    assert {op for t in heldout for op in t.metadata["ops"].split("|")} <= train_ops


def test_split_is_a_fixed_function_of_content():
    by_name = {op.name: op for op in OPS}
    assert (
        Program("int", [(by_name["mul"], {"k": 3})]).split() == Program("str", [(by_name["repeat"], {"k": 3})]).split()
    )
    splits = {Program(op.src, [(op, {"k": k})]).split() for op in OPS if "k" in op.params for k in op.params["k"]}
    assert splits == {"train", "heldout"}  # one-step tasks are split by constant as well


def test_instruction_and_solution_are_short():
    for task in generate(SynthConfig(count=50, difficulty=3)):
        assert len(task.instruction) < 220 and len(task.solution_files["solution.py"]) < 260


def test_config_rejects_inverted_difficulty_range():
    with pytest.raises(ValueError, match="min_difficulty"):
        SynthConfig(difficulty=2, min_difficulty=3)
