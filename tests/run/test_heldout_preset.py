"""The held-out preset with room to learn (configs/heldout-hard.toml): it loads and passes the
preflight, changes only the task sets of the default run, and no held-out task is ever trained on
while the train sets hold every skill the held-out set asks for."""

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

PRESET = Path(__file__).parents[2] / "configs" / "heldout-hard.toml"


def flat(data: dict, prefix: str = ""):
    for key, value in data.items():
        if isinstance(value, dict) and value:
            yield from flat(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


def code_lines(task: Task) -> tuple[str, ...]:
    """The reference solution's steps (`x = ...` lines), constants included."""
    return tuple(re.findall(r"^    x = (.*)$", task.solution_files["solution.py"], flags=re.M))


def test_the_heldout_preset_loads_and_passes_the_preflight_here(tmp_path):
    result = CliRunner().invoke(app, ["run", str(PRESET), "--dry-run", f'--set=output_dir="{tmp_path}"'])
    assert result.exit_code == 0, result.output
    printed = PipelineConfig.model_validate(tomllib.loads(result.stdout))
    held_out, train = printed.eval.tasks.synth, printed.rl.orchestrator.tasks.synth
    assert (held_out.split, held_out.min_difficulty, held_out.difficulty) == ("heldout", 2, 3)
    assert (train.split, train.min_difficulty, train.difficulty) == ("train", 2, 3)
    assert printed.eval.temperatures == [1.0, 0.5, 0.2]
    assert not (tmp_path / "heldout-hard").exists()


def test_the_heldout_preset_differs_from_the_default_run_only_in_its_task_sets():
    preset = dict(flat(load_config(PipelineConfig, PRESET).model_dump(mode="json")))
    default = dict(flat(PipelineConfig().model_dump(mode="json")))
    assert preset.keys() == default.keys()
    changed = {key for key in default if preset[key] != default[key]}
    assert changed == {
        "name",
        "eval.tasks.synth.min_difficulty",
        "eval.tasks.synth.difficulty",
        "rl.orchestrator.tasks.synth.difficulty",
    }


def test_no_heldout_task_of_the_preset_is_ever_trained_on():
    config = load_config(PipelineConfig, PRESET)
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
    ops = {op for task in held_out for op in str(task.metadata["ops"]).split("|")}
    assert ops <= {op for task in rl_tasks for op in str(task.metadata["ops"]).split("|")}
