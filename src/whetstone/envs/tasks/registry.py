"""Task sources by name, each with its config, and one way to load tasks from a name or a path.

    load_source("synth", ["count=50", "split=heldout"])   # a generator, with config overrides
    load_source("tasks.jsonl")                           # a JSONL file or a task folder

`TasksConfig` is the section other roles embed (e.g. the orchestrator's `[tasks]`): which source
to use, and the config of each generator.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from pydantic import Field

from whetstone.config import Config, expand_path, load_config
from whetstone.envs.task import Task
from whetstone.envs.tasks.humaneval import HumanEvalConfig
from whetstone.envs.tasks.io import Record, read_records
from whetstone.envs.tasks.mutate import MutateConfig
from whetstone.envs.tasks.repofix import RepofixConfig
from whetstone.envs.tasks.swebench import SwebenchConfig
from whetstone.envs.tasks.synth import SynthConfig
from whetstone.errors import WhetstoneError

if TYPE_CHECKING:
    from whetstone.envs.grading.reward import RewardConfig

# name -> (config class, module whose `generate(config)` makes the tasks)
SOURCES: dict[str, tuple[type[Config], str]] = {
    "synth": (SynthConfig, "whetstone.envs.tasks.synth"),
    "repofix": (RepofixConfig, "whetstone.envs.tasks.repofix"),
    "mutate": (MutateConfig, "whetstone.envs.tasks.mutate"),
    "humaneval": (HumanEvalConfig, "whetstone.envs.tasks.humaneval"),
    "swebench": (SwebenchConfig, "whetstone.envs.tasks.swebench"),
}


class TasksConfig(Config):
    """Where tasks come from."""

    source: str = "synth"
    """A source name (synth, repofix, mutate, humaneval, swebench) or a JSONL file / task folder."""
    synth: SynthConfig = SynthConfig()
    """Config of the `synth` generator."""
    repofix: RepofixConfig = RepofixConfig()
    """Config of the `repofix` generator."""
    mutate: MutateConfig = MutateConfig()
    """Config of the `mutate` generator."""
    humaneval: HumanEvalConfig = HumanEvalConfig()
    """Config of the `humaneval` loader."""
    swebench: SwebenchConfig = SwebenchConfig()
    """Config of the `swebench` loader."""
    validation_cache: str | None = None
    """JSON file remembering validation results by task content and grader, so a fixed set is validated once."""
    validation_workers: int = Field(2, ge=1)
    """Tasks validated at once (each runs two graded test runs in sandboxes)."""


def generator(name: str) -> Callable[[Config], list[Task]]:
    return importlib.import_module(SOURCES[name][1]).generate


def source_records(
    source: str, overrides: Sequence[str] = (), config_path: str | Path | None = None
) -> Iterator[Record]:
    """Records of a named source (built from its config file and overrides) or of a task file."""
    if source in SOURCES:
        config = load_config(SOURCES[source][0], config_path, overrides)
        for task in generator(source)(config):
            yield Record(task.id, task=task)
        return
    if overrides or config_path:
        raise WhetstoneError(
            f"config overrides apply to generated sources ({', '.join(SOURCES)}), not to the file {source}"
        )
    check_source(source)
    yield from read_records(source)


def check_source(source: str) -> None:
    """Raise unless `source` names a generator or an existing task file or folder (what loading
    it would find first; `whetstone run` asks before its first stage)."""
    if source in SOURCES or expand_path(source).exists():
        return
    if _looks_like_path(source):
        raise WhetstoneError(f"no such file: {source}")
    raise WhetstoneError(
        f"unknown task source {source!r}: give a JSONL file, a task folder, or one of {', '.join(SOURCES)}"
    )


def _looks_like_path(source: str) -> bool:
    """A source meant as a file or folder (a path separator or a suffix such as `.jsonl`), not a name."""
    return "/" in source or os.sep in source or bool(Path(source).suffix)


def load_source(source: str, overrides: Sequence[str] = (), config_path: str | Path | None = None) -> list[Task]:
    """All tasks of a source; a bad record raises a WhetstoneError naming it."""
    tasks = []
    for record in source_records(source, overrides, config_path):
        if record.task is None:
            raise WhetstoneError(f"{record.where}: {record.problem}")
        tasks.append(record.task)
    return tasks


def load_tasks(config: TasksConfig) -> list[Task]:
    """The tasks a `TasksConfig` names, not yet validated (see `load_valid_tasks`)."""
    if config.source in SOURCES:
        return generator(config.source)(getattr(config, config.source))
    return load_source(config.source)


def load_valid_tasks(config: TasksConfig, reward_config: RewardConfig | None = None) -> list[Task]:
    """The tasks that validate in sandboxes, graded as `reward_config` grades rollouts (its sandbox
    limits: a task valid under looser limits may not be under the run's); the others are reported
    on stderr and skipped."""
    from whetstone.envs.tasks.validate import valid_tasks

    return valid_tasks(
        load_tasks(config),
        workers=config.validation_workers,
        reward_config=reward_config,
        cache_path=config.validation_cache,
    )
