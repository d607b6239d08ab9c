"""The default run's task sets and the long preset (configs/long.toml): no held-out task is ever
trained on while the train sets hold every skill the held-out set asks for, and the preset loads,
passes the preflight and changes only the length of the run and the size of its evaluations."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

from typer.testing import CliRunner

from whetstone.cli import app
from whetstone.config import load_config
from whetstone.envs.task import Task
from whetstone.envs.tasks.synth import generate
from whetstone.run.config import PipelineConfig

PRESET = Path(__file__).parents[2] / "configs" / "long.toml"


def flat(data: dict, prefix: str = ""):
    for key, value in data.items():
        if isinstance(value, dict) and value:
            yield from flat(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


def code_lines(task: Task) -> tuple[str, ...]:
    """The reference solution's steps (`x = ...` lines), constants included."""
    return tuple(re.findall(r"^    x = (.*)$", task.solution_files["solution.py"], flags=re.M))


def test_the_long_preset_loads_and_passes_the_preflight_here(tmp_path):
    result = CliRunner().invoke(app, ["run", str(PRESET), "--dry-run", f'--set=output_dir="{tmp_path}"'])
    assert result.exit_code == 0, result.output
    printed = PipelineConfig.model_validate(tomllib.loads(result.stdout))
    assert printed.rl.steps > PipelineConfig().rl.steps
    assert not (tmp_path / "long").exists()


def test_the_long_preset_differs_from_the_default_run_only_in_length_and_evaluation_size():
    preset = dict(flat(load_config(PipelineConfig, PRESET).model_dump(mode="json")))
    default = dict(flat(PipelineConfig().model_dump(mode="json")))
    assert preset.keys() == default.keys()
    changed = {key for key in default if preset[key] != default[key]}
    assert changed == {"name", "rl.steps", "eval.samples"}


def test_no_heldout_task_of_the_default_run_is_ever_trained_on():
    config = PipelineConfig()
    held_out = generate(config.eval.tasks.synth)
    rl_tasks = generate(config.rl.orchestrator.tasks.synth)
    demos = generate(config.demos)
    trained = rl_tasks + demos
    assert {task.split for task in held_out} == {"heldout"}
    assert {task.split for task in trained} == {"train"}
    assert not {task.id for task in held_out} & {task.id for task in trained}
    assert not {task.instruction for task in held_out} & {task.instruction for task in trained}
    assert not {code_lines(task) for task in held_out} & {code_lines(task) for task in trained}
    # Instances differ, skills do not: RL trains on every step count and primitive held out.
    assert {task.difficulty for task in held_out} == {task.difficulty for task in rl_tasks} == {2, 3}
    assert {task.difficulty for task in demos} == {1, 2, 3}
    ops = {op for task in held_out for op in str(task.metadata["ops"]).split("|")}
    assert ops <= {op for task in rl_tasks for op in str(task.metadata["ops"]).split("|")}
