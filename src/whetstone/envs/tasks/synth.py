"""`synth`: procedurally generated function-synthesis tasks, the embedded default's RL curriculum.

A task composes 1..difficulty primitive steps (see synth_ops.py) into `solve(x)`:

    Write solve(x) in solution.py. x is a list of ints: add 3 to each element, then take the
    sum, and return the result.

    def solve(x):
        # add 3 to each element
        x = [v + 3 for v in x]
        # take the sum
        x = sum(x)
        return x

Visible tests (in the repository) and hidden tests (added at grading) use different inputs, so a
solution that special-cases the visible inputs fails. Expected outputs come from running the
reference solution, and a task is only kept if every step changes the result on its test inputs
(no step can be skipped) and no constant or identity function passes.

The held-out split differs in content, not only in seed: multi-step tasks are split by their
sequence of primitive code templates (held-out tasks are unseen compositions of seen primitives),
one-step tasks by their code line (primitive and constant). The split is a fixed hash, so train
and held-out never overlap whatever the seeds or counts.
"""

from __future__ import annotations

import copy
import hashlib
import random
from dataclasses import dataclass

from pydantic import Field, model_validator

from whetstone.config import Config
from whetstone.envs.task import Split, Task
from whetstone.envs.tasks.synth_ops import OPS_BY_TYPE, TYPE_NAMES, Op, random_input
from whetstone.errors import WhetstoneError

HELDOUT_BUCKETS = 4
"""One composition in this many belongs to the held-out split."""
MAX_OUTPUT_CHARS = 60
"""Longer expected outputs are rejected: tests must stay a few tokens long for a tiny model."""


class SynthConfig(Config):
    """How many synth tasks to make, how hard, from which seed and split."""

    count: int = Field(1000, ge=0)
    """Number of tasks."""
    difficulty: int = Field(2, ge=1, le=6)
    """Most composed steps in a task; each task draws its step count from min_difficulty..difficulty."""
    min_difficulty: int = Field(1, ge=1)
    """Fewest composed steps in a task."""
    seed: int = 0
    """Generation seed; the same config always gives the same tasks."""
    split: Split = "train"
    """`train` (RL and demonstrations) or `heldout` (unseen compositions, evaluation only)."""
    visible_cases: int = Field(3, ge=1)
    """Test cases in the repository's test_solution.py, which the agent can run."""
    hidden_cases: int = Field(5, ge=1)
    """Test cases with other inputs in test_hidden.py, added only at grading."""

    @model_validator(mode="after")
    def _range(self) -> "SynthConfig":
        if self.min_difficulty > self.difficulty:
            raise ValueError(f"min_difficulty ({self.min_difficulty}) exceeds difficulty ({self.difficulty})")
        return self


@dataclass
class Program:
    """A chain of primitive steps applied to an input of `input_type`."""

    input_type: str
    steps: list[tuple[Op, dict[str, object]]]

    def split(self) -> str:
        """By code, not by name: `repeat it 3 times` and `multiply by 3` are both `x * 3`."""
        if len(self.steps) > 1:
            key = "|".join(op.code for op, _ in self.steps)
        else:
            op, params = self.steps[0]
            key = op.code.format(**params)
        bucket = int(hashlib.sha256(key.encode()).hexdigest()[:8], 16) % HELDOUT_BUCKETS
        return "heldout" if bucket == 0 else "train"

    def source(self, skip: int | None = None) -> str:
        """The reference solution: each step's line under a comment naming the step. The comment
        is the plan written out: a model that copies the next phrase of the instruction then has
        the phrase right above the line it must write (demonstrations teach exactly this)."""
        lines = [
            f"    # {op.phrase.format(**params)}\n    x = {op.code.format(**params)}"
            for i, (op, params) in enumerate(self.steps)
            if i != skip
        ]
        return "def solve(x):\n" + "\n".join(lines) + "\n    return x\n"

    def instruction(self) -> str:
        phrases = ", then ".join(op.phrase.format(**params) for op, params in self.steps)
        return f"Write solve(x) in solution.py. x is {TYPE_NAMES[self.input_type]}: {phrases}, and return the result."


def random_program(rng: random.Random, steps: int) -> Program:
    input_type = rng.choice(sorted(OPS_BY_TYPE))
    chain, kind = [], input_type
    for _ in range(steps):
        op = rng.choice(OPS_BY_TYPE[kind])
        chain.append((op, op.sample(rng)))
        kind = op.dst
    return Program(input_type, chain)


def run_source(source: str, inputs: list[object]) -> list[object]:
    """Outputs of our own generated `solve` (trusted code: it is built here from the table)."""
    namespace: dict[str, object] = {}
    exec(compile(source, "<synth>", "exec"), namespace)
    return [namespace["solve"](copy.deepcopy(value)) for value in inputs]  # type: ignore[operator]


def _outputs_or_none(source: str, inputs: list[object]) -> list[object] | None:
    try:
        return run_source(source, inputs)
    except Exception:
        return None


def _distinct_inputs(kind: str, rng: random.Random, n: int) -> list[object]:
    seen: dict[str, object] = {}
    for _ in range(50 * n):
        value = random_input(kind, rng)
        seen.setdefault(repr(value), value)
        if len(seen) == n:
            return list(seen.values())
    raise WhetstoneError(f"could not draw {n} distinct {kind} inputs")


def _acceptable(program: Program, inputs: list[object], outputs: list[object]) -> bool:
    if any(len(repr(out)) > MAX_OUTPUT_CHARS for out in outputs):
        return False
    if len({repr(out) for out in outputs}) == 1:  # a constant function would pass
        return False
    if all(repr(out) == repr(value) for value, out in zip(inputs, outputs)):  # so would identity
        return False
    for i in range(len(program.steps)):  # every step must matter, or the tests cannot check it
        if _outputs_or_none(program.source(skip=i), inputs) == outputs:
            return False
    return True


def _test_file(cases: list[tuple[object, object]]) -> str:
    tests = [f"def test_{i}():\n    assert solve({value!r}) == {out!r}\n" for i, (value, out) in enumerate(cases, 1)]
    return "from solution import solve\n\n\n" + "\n\n".join(tests)


def make_task(config: SynthConfig, index: int) -> Task:
    rng = random.Random(f"synth/{config.seed}/{config.split}/{index}")
    steps = rng.randint(config.min_difficulty, config.difficulty)  # drawn once: rejection must not skew it
    for _ in range(10_000):
        program = random_program(rng, steps)
        if program.split() != config.split:
            continue
        inputs = _distinct_inputs(program.input_type, rng, config.visible_cases + config.hidden_cases)
        outputs = _outputs_or_none(program.source(), inputs)
        if outputs is None or not _acceptable(program, inputs, outputs):
            continue
        cases = list(zip(inputs, outputs))
        visible, hidden = cases[: config.visible_cases], cases[config.visible_cases :]
        test_ids = [f"test_solution.py::test_{i}" for i in range(1, len(visible) + 1)]
        test_ids += [f"test_hidden.py::test_{i}" for i in range(1, len(hidden) + 1)]
        return Task(
            id=f"synth/{config.split}/s{config.seed}-{index:05d}",
            source="synth",
            split=config.split,
            kind="synthesis",
            instruction=program.instruction(),
            repo_files={"test_solution.py": _test_file(visible)},
            visible_tests=["test_solution.py"],
            hidden_tests={"test_hidden.py": _test_file(hidden)},
            solution_files={"solution.py": program.source()},
            fail_to_pass=test_ids,
            time_limit_s=120.0,
            test_time_limit_s=20.0,
            protected_paths=["test_*.py"],
            difficulty=len(program.steps),
            metadata={
                "ops": "|".join(op.name for op, _ in program.steps),
                "input_type": program.input_type,
                "seed": config.seed,
            },
        )
    raise WhetstoneError(f"synth: no acceptable task found for index {index} (config {config})")


def generate(config: SynthConfig = SynthConfig()) -> list[Task]:
    """`config.count` tasks of one split, deterministic in the config."""
    return [make_task(config, index) for index in range(config.count)]
