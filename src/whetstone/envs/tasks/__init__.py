"""Coding tasks: the task sources, reading and writing task sets, and validation.

Sources (registry.py): `synth` (generated function synthesis, the embedded default's curriculum),
`repofix` (bugs in small generated multi-file repositories), `mutate` (SWE-smith-style bugs in any
local Python project), `humaneval` (the 164 HumanEval problems) and `swebench` (SWE-bench-format
JSONL over local clones). Every task is validated in sandboxes before use (validate.py).
See docs/tasks.md.
"""

from whetstone.envs.tasks.io import read_records, read_tasks, write_tasks
from whetstone.envs.tasks.registry import SOURCES, TasksConfig, load_source, load_tasks, load_valid_tasks
from whetstone.envs.tasks.validate import ValidationReport, check_task, valid_tasks, validate_records, validate_tasks

__all__ = [
    "SOURCES",
    "TasksConfig",
    "ValidationReport",
    "check_task",
    "load_source",
    "load_tasks",
    "load_valid_tasks",
    "read_records",
    "read_tasks",
    "valid_tasks",
    "validate_records",
    "validate_tasks",
    "write_tasks",
]
