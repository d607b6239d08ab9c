"""docs/configuration.md, generated from the config classes' field docstrings.

`python -m whetstone.config_reference > docs/configuration.md`; a test keeps the file current.
`python -m whetstone.config_reference task` prints the task record's field table of docs/tasks.md.
"""

from __future__ import annotations

import importlib
import sys

from whetstone.config import config_reference

# (title, module, class): the config each command loads from its TOML file.
COMMANDS = [
    ("whetstone run", "whetstone.run.config", "PipelineConfig"),
    ("whetstone midtrain", "whetstone.midtrain.config", "MidtrainConfig"),
    ("whetstone serve", "whetstone.inference.config", "ServeConfig"),
    ("whetstone trainer", "whetstone.trainer.config", "TrainerConfig"),
    ("whetstone orchestrator", "whetstone.orchestrator.config", "OrchestratorConfig"),
    ("whetstone eval", "whetstone.envs.eval.config", "EvalConfig"),
    ("whetstone online", "whetstone.online.config", "OnlineConfig"),
    ("whetstone tasks (task sources)", "whetstone.envs.tasks.registry", "TasksConfig"),
    ("weight sync (the [sync] sections)", "whetstone.sync.config", "SyncConfig"),
]

HEADER = """# Configuration reference

Every command takes an optional TOML file and `--set key.sub=value` overrides; unknown keys and
wrong types are refused with the key named. Every field has a default that serves the embedded
default run. Generated from the code: `python -m whetstone.config_reference > docs/configuration.md`.
"""


def render() -> str:
    parts = [HEADER]
    for title, module, name in COMMANDS:
        parts.append(config_reference(getattr(importlib.import_module(module), name), title))
    return "\n".join(parts)


def render_task_record() -> str:
    """The field table of docs/tasks.md: `python -m whetstone.config_reference task`."""
    from whetstone.envs.task import Task

    reference = config_reference(Task, "The task record")
    return reference[reference.index("| key |") :]  # the table alone: the page has its own heading


if __name__ == "__main__":
    print(render_task_record() if sys.argv[1:] == ["task"] else render(), end="")
