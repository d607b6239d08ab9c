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

Every command takes an optional TOML file and `--set key.sub=value` overrides; unknown keys,
wrong types and numbers that are not finite (`nan`, `inf`) are refused with the key named. An
override's value is a TOML literal, or plain text where it is not one; TOML has no null, so
`--set key=` (nothing after the `=`) sets an optional field (a default of None) back to None.
Every field has a default that serves the embedded default run. Generated from the code:
`python -m whetstone.config_reference > docs/configuration.md`.

Paths (model folders, stores, output folders, task files, the feedback store) are expanded as a
shell would expand them, since a TOML value or a `--set` value never passes through one: `~` is
your home folder, and `$NAME` or `${NAME}` is that environment variable (one that is not set is
refused, named). A relative path resolves against the working directory of the command, not
against the folder of the config file.
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


USAGE = """usage: python -m whetstone.config_reference [task]

Print docs/configuration.md (every command's config fields), or with `task` the field table of
the task record in docs/tasks.md."""


def main(args: list[str]) -> int:
    """The module's command line: no argument or `task`; `-h`/`--help` prints the usage, anything
    else is refused with it (exit 2), not answered with the whole reference."""
    if args in ([], ["task"]):
        print(render_task_record() if args else render(), end="")
        return 0
    if args in (["-h"], ["--help"]):
        print(USAGE)
        return 0
    print(f"error: unexpected argument{'s' * (len(args) > 1)}: {' '.join(args)}\n{USAGE}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
