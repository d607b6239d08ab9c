"""The stages of `whetstone run`, one after the other, on this machine:

    1. midtrain      the tiny MoE on code + synth demonstrations        -> midtrain/model
    2. servers       `whetstone serve` x N, following the weight store  -> servers/, logs/
    3. eval before   held-out pass@1 of the mid-trained model at each    -> eval/before/
                     temperature of `eval.temperatures`
    4. rl            `whetstone trainer` + `whetstone orchestrator`      -> trainer/, orchestrator/,
                     as processes, until the trainer's last step           batches/, weights/
    5. eval after    once every server holds the final version; the      -> eval/after/
                     same temperatures, and the headline one x the
                     learned logit scale
    6. report        the final policy as an HF folder, summary.json      -> model/
                     (each model at its best temperature compared),
                     report.html

Each stage resumes: mid-training from its checkpoint, the trainer from its own, the orchestrator
from the next batch index, and an evaluation whose report evaluated what it would evaluate now
(the same mid-trained model, trainer step and temperatures: `evaluated.json`) is not run again.
The evaluation before RL runs only while the weight store holds nothing past version 0, the
mid-trained model: the servers follow the store (`Pipeline.check_serving_initial_weights`).
RL goes on only from state begun from the mid-trained model the run folder holds now
(`rl_model.json`, `Pipeline.check_rl_model`); starting RL over removes all of that state
(`Pipeline.rl_state`).
A run first removes the summary.json, report.html and model/ an earlier run in its folder left:
written again once every stage has run, they would otherwise show that run's results after a run
that failed. Mid-training alone (`--midtrain-only`) removes them once it leaves another mid-trained
model than the one they were of (`Pipeline.midtrain_alone`).
"""

from __future__ import annotations

import contextlib
import functools
import gc
import hashlib
import json
import logging
import math
import os
import shutil
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from whetstone.config import without_secrets, write_toml
from whetstone.errors import ConfigError, WhetstoneError
from whetstone.run.config import SERVER_TOKEN_ENV, PipelineConfig
from whetstone.run.local_ranks import LocalRankGroup
from whetstone.run.monitor import ServerSampler, last_record, read_json_object
from whetstone.run.placement import gpu_memory_shares, role_device, server_device
from whetstone.run.ray_launch import RayLauncher
from whetstone.store import open_store
from whetstone.utils.atomic import atomic_directory, atomic_write_json, write_errors
from whetstone.utils.cgroups import PERIOD_US, CpuGroup
from whetstone.utils.metrics import read_metrics
from whetstone.utils.processes import GPU_MEMORY_ENV, RoleProcess, Stopping, free_ports, stopped_by
from whetstone.utils.progress import progress_bar
from whetstone.utils.runtime import usable_cores

log = logging.getLogger("whetstone.run")
YARDSTICK_KEYS = (
    "gain_over_best_temperature",
    "gain_over_best_temperature_se",
    "gain_scale_frozen",
    "gain_scale_frozen_se",
    "temperature_sweep",
)
"""The summary's keys comparing the evaluations' temperature sweeps (`Pipeline.yardstick`)."""
EVALUATED_FILE = "evaluated.json"
"""Beside an evaluation's report.json: what it evaluated (`Pipeline.evaluated`)."""
RL_MODEL_FILE = "rl_model.json"
"""In the run folder: the mid-trained model that RL's state there began from (`Pipeline.check_rl_model`)."""
RESULT_FILES = ("summary.json", "report.html", "model")
"""What a run writes of its results once it has run every stage: its summary, its report and its
final policy, exported (`Pipeline.remove_last_results`)."""
STOP_GRACE_S = 600.0
"""How long a trainer told to stop at `rl.max_wall_time` may take to finish its step, checkpoint
and publish before it is killed (a step of the default run on two cores takes ~20 s)."""
TRAINER_QUOTA_PERIOD_US = 10_000
"""The trainer's CPU quota is enforced every 10 ms, not the kernel's 100: a trainer that idles
between steps (synchronous RL) starts each step with a whole period's quota unspent, and with
100 ms periods it ran at 1.23x its quota (`whetstone bench pipeline`), as if on
bigger hardware than the quota sizes; at 10 ms, 1.05x. The rollout side keeps 100 ms: its many
processes' bursts would be throttled more often, and it is not bound by its quota."""


def release_gpu_memory() -> None:
    """Give back the GPU memory this process's caching allocator still holds (nothing to do
    where CUDA was never used)."""
    import torch

    if torch.cuda.is_initialized():
        gc.collect()
        torch.cuda.empty_cache()


def folder_digest(folder: Path) -> str:
    """sha256 over the files of `folder` (names and contents): a copy of the same files reads the
    same, other files do not."""
    digest = hashlib.sha256()
    for file in sorted(p for p in folder.rglob("*") if p.is_file()):
        digest.update(f"{file.relative_to(folder)}\0".encode())
        with open(file, "rb") as handle:
            for block in iter(lambda: handle.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()


def demo_source(config: PipelineConfig):
    """Transcripts of solved synth train tasks, generated only when the corpus is (re)built."""
    if config.demos.split != "train":
        raise ConfigError("demos.split must be 'train': held-out tasks never enter mid-training")

    def transcripts():
        from whetstone.envs.harness.loop import CHARS_PER_TOKEN
        from whetstone.envs.tasks.demonstrations import demonstrations
        from whetstone.envs.tasks.synth import generate

        tool_chars = config.harness.max_tool_tokens * CHARS_PER_TOKEN  # the harness's cut of tool outputs
        return demonstrations(
            generate(config.demos),
            config.demo_recovery,
            tool_chars,
            seed=config.demos.seed,
            attempt=config.demo_recovery_attempt,
        )

    return transcripts if config.demos.count else None


def rank_threads(threads: int, ranks: int, cores: int = 0) -> int:
    """Each of `ranks` processes' share of a role's `threads` (0: all its `cores`, or every core
    this process may use where it has none of its own)."""
    return max(1, (threads or cores or usable_cores()) // ranks)


def midtrain_stage(config: PipelineConfig) -> dict[str, Any]:
    """The run's mid-training (`config` as resolved, with its demonstrations) in this process, or
    under torchrun this rank's part of it; its summary."""
    from whetstone.midtrain.cli import run_midtrain

    return run_midtrain(config.midtrain, demos=demo_source(config))


class Pipeline:
    def __init__(self, config: PipelineConfig):
        self.config = config.resolved()
        """The config as the stages run it (`PipelineConfig.resolved`); once the servers are up,
        with their addresses."""
        self.run_dir = self.config.run_dir
        self.model_dir = Path(self.config.rl.trainer.model_path)
        """The mid-trained model: RL's initial policy and every server's first weights."""
        self.roles: list[RoleProcess] = []
        self.urls: list[str] = []
        self.sampler: ServerSampler | None = None
        """Samples the servers' /metrics while they run (versions, swap pauses, busy)."""
        self.launcher = (
            RayLauncher(self.config.placement.ray, self.run_dir) if self.config.placement.backend == "ray" else None
        )
        """Starts the roles on a Ray cluster (`placement.backend = "ray"`); None: processes here."""
        self.rl_steps: int | None = None
        """The step RL ended at (its final policy's): `rl.steps`, or fewer when `rl.max_wall_time`
        stopped it; None before the RL stage ran."""
        self.cpu_groups: dict[str, CpuGroup] = {}
        """CPU groups by side (`trainer`, `rollout`: servers, orchestrator, sandboxes): their CPU
        time, sampled into `cpu.jsonl`, and the quotas of `placement`'s cores fields."""

    # -- role configs: the resolved config's sections, with what only the run knows ----------

    def trainer_config(self):
        trainer = self.config.rl.trainer
        if trainer.demo_coef > 0 and not trainer.demos_path:
            return trainer.model_copy(update={"demos_path": str(self.demos_path)})
        return trainer

    @property
    def demos_path(self) -> Path:
        """The mid-training demonstrations, for the trainer's anchor (`rl.trainer.demo_coef`)."""
        return self.run_dir / "demos.jsonl"

    def write_demos(self) -> None:
        """Write the mid-training demonstrations for the trainer's anchor, unless it has its own
        file or no anchor; they are generated again (seconds: no sandbox work without recovery)."""
        from whetstone.rl.demos import write_demos

        trainer = self.config.rl.trainer
        if trainer.demo_coef == 0 or trainer.demos_path or self.demos_path.exists():
            return
        write_demos(self.demos_path, demo_source(self.config)())  # demos.count > 0 (PipelineConfig checks)

    def orchestrator_config(self):
        """On Ray, the orchestrator takes its servers from the fleet registry only: a server that
        dies leaves it, and one Ray restarts comes back at a new address."""
        if self.launcher is not None:
            return self.config.rl.orchestrator.model_copy(update={"servers": [], "discover_servers": True})
        return self.config.rl.orchestrator

    def eval_config(self, when: str, logit_scale: float | None = None):
        """The evaluation `when` ("before"/"after" RL). After RL with a learned `logit_scale`, it
        also samples at the headline temperature x the scale: the trained weights at the base's
        scale (`gain_scale_frozen`, envs/eval/sweep.py)."""
        config = self.config.eval
        update: dict[str, Any] = {"output_dir": str(Path(config.output_dir) / when)}
        if logit_scale is not None:
            update["temperatures"] = [*config.temperatures, config.harness.sampling.temperature * logit_scale]
        return config.model_copy(update=update)

    def serve_config(self, port: int, index: int = 0):
        """Server `index`'s config: its port, and its device from `placement.server_devices`."""
        serve = self.config.servers.serve
        engine = serve.engine.model_copy(update={"device": server_device(self.config.placement, index)})
        return serve.model_copy(update={"port": port, "engine": engine})

    def role_environment(self, name: str) -> dict[str, str]:
        """Extra environment of role `name`: its share of the GPU it shares with other roles."""
        shares = gpu_memory_shares(self.config.placement, self.config.servers.count)
        if name not in shares:
            return {}
        device, fraction = shares[name]
        return {GPU_MEMORY_ENV: f"{device}={fraction:.6g}"}

    def client_environment(self) -> dict[str, str]:
        """The environment the run's clients of its servers need besides their own (the
        orchestrator; the evaluations, in this process: `client_key`): the servers'
        `auth_token` in `SERVER_TOKEN_ENV`, which their endpoints' `api_key_env` names
        (`PipelineConfig.resolved`); nothing when the servers take no token. No other role gets it,
        and no role's config file holds it but the servers' own."""
        token = self.config.servers.serve.auth_token
        return {SERVER_TOKEN_ENV: token} if token else {}

    @contextlib.contextmanager
    def client_key(self) -> Iterator[None]:
        """The block with `client_environment` in this process's environment, as it was after:
        for the evaluations, which run here. No role starts meanwhile to inherit it, and the
        sandboxes of their rollouts get an environment of their own."""
        added = self.client_environment()
        before = {name: os.environ.get(name) for name in added}
        os.environ.update(added)
        try:
            yield
        finally:
            for name, value in before.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value

    def write_config(self) -> None:
        """`config.toml`: the config as the stages run it (again once the servers' addresses are known)."""
        write_toml(self.run_dir / "config.toml", self.config)

    def write_role_config(self, name: str, config) -> Path:
        path = self.run_dir / "roles" / f"{name}.toml"
        path.parent.mkdir(parents=True, exist_ok=True)
        write_toml(path, config)
        return path

    def open_cpu_groups(self) -> None:
        """Create each side's CPU group (once). A quota `placement` asks for that cannot be set is
        an error, raised early, and the groups this call made are removed first; without quotas
        the groups only count CPU time, where cgroups allow."""
        placement = self.config.placement
        made = []
        try:
            for side, cores in (("trainer", placement.trainer_cores), ("rollout", placement.rollout_cores)):
                if side in self.cpu_groups:
                    continue
                try:
                    period = TRAINER_QUOTA_PERIOD_US if side == "trainer" else PERIOD_US
                    self.cpu_groups[side] = CpuGroup(side, cores, period_us=period)
                    made.append(side)
                except WhetstoneError:
                    if cores > 0:
                        raise
                    log.debug("no CPU accounting for the %s side: cgroups are not writable here", side)
        except BaseException:
            for side in made:
                self.cpu_groups.pop(side).remove()
            raise

    def start(
        self,
        name: str,
        command: str,
        config,
        *,
        threads: int,
        cpus: list[int],
        side: str,
        health_url: str | None = None,
        argv: list[str] | None = None,
        env: dict[str, str] | None = None,
        ranks: int = 1,
        options: tuple[str, ...] = (),
    ) -> RoleProcess:
        """Start role `name`, `whetstone <command> <its config> <options>`; `side` (`trainer` or
        `rollout`) picks its CPU group. `argv`: a whole command line instead (a vLLM server).
        `env`: more of its environment, here or on Ray (`client_environment`). `ranks` > 1: that
        many processes of it, the ranks of one job (`LocalRankGroup`), each with `threads`."""
        if self.launcher is not None:
            role = self.launcher.role(name, command, config, env=env)
            self.roles.append(role)
            return role
        if side:  # mid-training's ranks run in none
            self.open_cpu_groups()
        path = self.write_role_config(name, config)
        log_path = self.run_dir / "logs" / f"{name}.log"
        processes = dict(
            env={**self.role_environment(name), **(env or {})}, cpus=cpus, cpu_group=self.cpu_groups.get(side)
        )
        args = [command, str(path), *options]
        if ranks > 1:
            role = LocalRankGroup(name, args, log_path, ranks, threads=threads, **processes)
        else:
            role = RoleProcess(name, args, log_path, health_url=health_url, threads=threads, command=argv, **processes)
        self.roles.append(role.start())
        return role

    # -- stages -------------------------------------------------------------------------------

    def midtrain(self) -> dict[str, Any]:
        if self.launcher is not None and self.config.placement.ray.midtrain is not None:
            return self.launcher.midtrain(self.config, self.follow_midtrain)  # on nodes of the cluster
        ranks = self.config.placement.midtrain_ranks
        if ranks > 1:  # processes of this machine, sharing its threads
            run = self.config.midtrain.run
            threads = rank_threads(run.threads, ranks)
            midtrain = self.config.midtrain.model_copy(update={"run": run.model_copy(update={"threads": threads})})
            group = self.start(
                "midtrain",
                "run",
                self.config.model_copy(update={"midtrain": midtrain}),
                threads=threads,
                cpus=[],
                side="",
                ranks=ranks,
                options=("--midtrain-only",),
            )
            self.follow_midtrain(group)
            return json.loads((run.run_dir / "summary.json").read_text())
        summary = midtrain_stage(self.config)
        release_gpu_memory()  # mid-training ran in this process: its GPU memory goes to the roles
        return summary

    def midtrain_alone(self) -> dict[str, Any]:
        """Mid-training without the stages after it (`whetstone run --midtrain-only`). The results
        an earlier whole run left (`RESULT_FILES`) are of the mid-trained model it found: once
        mid-training has left another one, or failed after replacing it, they are removed, since
        they describe a run of a model the folder no longer holds; a mid-training that changed
        nothing (finished already) leaves them."""

        def digest() -> str | None:  # None: no model; "": one changing as it is read (ranks still stopping)
            try:
                return folder_digest(self.model_dir) if self.model_dir.is_dir() else None
            except OSError:
                return ""

        before = digest()
        try:
            return self.midtrain()
        finally:
            if digest() != before:
                self.remove_last_results()

    def follow_midtrain(self, role: RoleProcess) -> None:
        """Wait for mid-training run by `role` (ranks of this machine or of a Ray cluster), its
        progress (from rank 0's metrics) on the bar mid-training in this process would show;
        raises if it failed."""
        from whetstone.training.checkpoint import checkpoint_step, latest_checkpoint

        run, data = self.config.midtrain.run, self.config.midtrain.data
        step_tokens = run.batch_size * run.grad_accum * data.seq_len
        metrics = run.run_dir / "metrics.jsonl"
        resumed = latest_checkpoint(run.run_dir / "checkpoints") if run.resume else None
        done = checkpoint_step(resumed) if resumed is not None else 0  # where the ranks start
        # an older run's records, appended to (a fresh start moves them aside), or rewritten without
        # those after the checkpoint (a new file: `MetricsWriter`'s `resume_at`)
        before = metrics.stat() if metrics.exists() and run.resume else None
        with progress_bar(max(0, run.steps - done) * step_tokens, f"midtrain {run.name}", "tok") as bar:
            while True:
                running = role.running
                # read after the look, so the last step shows; only what the ranks wrote
                record = last_record(metrics) if _written_since(metrics, before) else {}
                step = record.get("step", done)
                fields = {"step": step, "loss": record["loss"]} if "loss" in record else {"step": step}
                bar.update(max(0, step - done) * step_tokens, **fields)  # an evaluation's record has no loss
                done = max(done, step)
                if not running:
                    break
                time.sleep(1.0)
        role.check()

    def start_servers(self) -> None:
        servers = self.config.servers
        # servers follow the weight store before the trainer's first publish, and a missing store is an error
        orchestrator = self.config.rl.orchestrator
        open_store(orchestrator.weight_store, endpoint_url=orchestrator.store_endpoint_url)  # a local one is created
        sync = self.config.rl.trainer.sync
        for store in sync.mirrors:  # the clusters' stores (placement.ray.cluster_stores): created if local
            open_store(store, endpoint_url=sync.endpoint_url)
        if self.launcher is not None:
            return self.start_ray_servers()
        ports = (
            [servers.base_port + i for i in range(servers.count)] if servers.base_port else free_ports(servers.count)
        )
        self.urls = [f"http://127.0.0.1:{port}/v1" for port in ports]
        self.config = self.config.resolved(self.urls)
        self.write_config()
        started = [
            self.start(
                f"serve-{i}",
                "serve",
                self.serve_config(port, i),
                threads=servers.serve.threads or 1,
                cpus=self.config.placement.servers,
                side="rollout",
                health_url=f"http://127.0.0.1:{port}/health",
                **(self.vllm_server(port, i) if servers.engine == "vllm" else {}),
            )
            for i, port in enumerate(ports)
        ]
        for role in started:
            role.wait_healthy(servers.start_timeout_s)

    def start_ray_servers(self) -> None:
        """The servers as Ray actors, each on a free port of its node: addresses known once placed."""
        from whetstone.run.ray_launch import VllmServer

        self.launcher.connect()
        servers, vllm = self.config.servers, None
        if servers.engine == "vllm":
            from whetstone.integrations.vllm import vllm_python

            # checked on each server's node: the machine of `whetstone run` need not have it
            vllm = VllmServer(
                python=vllm_python(servers.vllm_python, here=False),
                args=servers.vllm_args,
                pause_limit_s=servers.vllm_pause_limit_s,
            )
        started = []
        for i in range(servers.count):
            role = self.launcher.server(f"serve-{i}", i, self.serve_config(1, i), vllm)
            self.roles.append(role)
            started.append(role)
        for role in started:
            role.wait_healthy(servers.start_timeout_s)
        self.urls = [role.url for role in started]
        self.config = self.config.resolved(self.urls)
        self.write_config()

    def vllm_server(self, port: int, index: int) -> dict[str, Any]:
        """How `start` runs vLLM server `index` on `port` (`servers.engine = "vllm"`): its command
        line (`integrations.vllm_serve` with the vLLM environment's python, following the weight
        store, on its GPU and share of that GPU's memory) and whetstone on its PYTHONPATH."""
        from whetstone.integrations.vllm import vllm_launch, vllm_python

        servers = self.config.servers
        device = role_device(server_device(self.config.placement, index))  # as vLLM's own process resolves it
        _, share = gpu_memory_shares(self.config.placement, servers.count).get(f"serve-{index}", (device, None))
        python = vllm_python(servers.vllm_python, here=False)  # vllm_launch checks it
        folder = self.run_dir / "servers" / "vllm-path"
        argv, env = vllm_launch(
            python, self.serve_config(port, index), device, share, servers.vllm_args, folder, servers.vllm_pause_limit_s
        )
        return {"argv": argv, "env": env}

    def evaluate(self, when: str, logit_scale: float | None = None) -> dict[str, Any]:
        """The evaluation `when` ("before"/"after" RL): its report, run again only when what it
        would evaluate (`evaluated`) differs from what the report in its folder evaluated, and
        before RL only while the servers serve the mid-trained model (`check_serving_initial_weights`)."""
        from whetstone.envs.eval.run import evaluate_with_progress, load_eval_tasks

        config = self.eval_config(when, logit_scale)
        folder = Path(config.output_dir)
        report_path, record_path = folder / "report.json", folder / EVALUATED_FILE
        evaluated = json.loads(json.dumps(self.evaluated(when, config)))  # as it reads back
        if report_path.exists() and same_evaluation(read_json_object(record_path), evaluated):  # it ran: resume past it
            return json.loads(report_path.read_text())
        if self.sampler is not None:
            self.sampler.check()  # no evaluation of minutes when the run is to stop
        if when == "before":
            self.check_serving_initial_weights(folder)
        # the report in the folder is about to be replaced: an evaluation that writes its report and
        # then fails (report.md on a full disk, a Ctrl-C) must not leave it under the last one's record
        with write_errors(record_path):
            record_path.unlink(missing_ok=True)
        with self.client_key():
            report = evaluate_with_progress(config, load_eval_tasks(config), f"held-out eval ({when})")
        with write_errors(record_path):
            atomic_write_json(record_path, evaluated)
        return report

    def check_serving_initial_weights(self, folder: Path) -> None:
        """Raise unless the servers serve the mid-trained model (weight version 0), for the
        evaluation before RL in `folder` to run: they follow the weight store, so once the trainer
        has published a step it would measure RL-trained weights under a record naming the
        mid-trained model. A report there without a matching record is not taken instead: nothing
        in it identifies the weights it evaluated."""
        from whetstone.sync import WeightStore

        sync = self.config.servers.serve.sync
        latest = WeightStore.open(sync).latest()
        if latest:  # None or 0: nothing but the mid-trained model was published
            raise WhetstoneError(
                f"the evaluation before RL in {folder} would run again (no report there with an {EVALUATED_FILE} "
                f"of this mid-trained model and these settings), but the servers follow the weight store "
                f"{sync.store}, which holds RL-trained version {latest}: it would measure those weights. Rerun "
                f"with the settings it ran with, or {self.start_rl_over()}"
            )

    def rl_state(self) -> dict[str, str | None]:
        """Everything RL leaves that a later RL in this run folder goes on from: the trainer's
        output_dir (checkpoints, metrics), the weight store (the servers load its newest version,
        the trainer continues its chain), the batch store (the orchestrator puts the batches after
        its newest, and the trainer's step n trains on its batch n, a trainer started afresh too),
        the weight store's mirrors (a Ray run's clusters' servers follow them) and the
        orchestrator's folder (its metrics, appended to). Starting RL over is removing all
        of them: one left behind has the next RL go on from the last one's. Each location with
        the S3 endpoint it is reached at (None: a local folder's)."""
        trainer, orchestrator = self.config.rl.trainer, self.config.rl.orchestrator
        stores = [trainer.sync.store, *trainer.sync.mirrors]  # a Ray run's clusters follow the mirrors
        return {
            trainer.output_dir: None,
            **dict.fromkeys(stores, trainer.sync.endpoint_url),
            orchestrator.batch_store: orchestrator.store_endpoint_url,
            str(self.run_dir / "orchestrator"): None,
        }

    def start_rl_over(self) -> str:
        """The advice to start RL over, naming what to remove (`rl_state`)."""
        *rest, last = self.rl_state()
        return f"start RL over (remove {', '.join(rest)} and {last})"

    def check_rl_model(self) -> None:
        """Raise unless RL's state in the run folder (`rl_state`) began from the mid-trained model
        the folder holds now, by the digest `RL_MODEL_FILE` recorded when it began; where there is
        no such state, record this model. State of another model (mid-training run again since,
        `--midtrain-only` or other settings) would be gone on from: the trainer resumes a
        checkpoint trained from that model, the servers load the weight store's versions made
        from it, and its rollouts are trained on. State without a record is refused too: nothing
        in it says which model it began from."""
        record_path = self.run_dir / RL_MODEL_FILE
        model = {"model": str(self.model_dir), "model_sha256": self.model_digest}
        left = [where for where, endpoint in self.rl_state().items() if _holds_something(where, endpoint)]
        if not left:
            with write_errors(record_path):
                atomic_write_json(record_path, model)
            return
        recorded = read_json_object(record_path).get("model_sha256")
        if recorded == self.model_digest:
            return
        began = (
            f"began from the mid-trained model of sha256 {recorded} ({record_path})"
            if recorded
            else f"has no record of the mid-trained model it began from ({record_path})"
        )
        raise WhetstoneError(
            f"RL's state in {', '.join(left)} {began}, not from {self.model_dir} (sha256 "
            f"{self.model_digest}): the trainer would resume from that model's checkpoints, the servers load "
            f"weights made from it, and its rollouts be trained on. To train RL from this model, {self.start_rl_over()}"
        )

    def evaluated(self, when: str, config) -> dict[str, Any]:
        """What evaluation `when` with `config` evaluates, recorded beside its report: the
        mid-trained model (the policy before RL, RL's start after it), by the digest of its
        folder; after RL, the trainer's step (the weight version the servers hold) and the digest
        of that checkpoint's weights; the tasks, samples, seed and temperatures, the k of its
        pass@k, and the harness, sandbox and reward settings its rollouts ran and were graded with
        (not those that change no result: concurrency, where workspaces are kept, the judge's
        timeout and key)."""
        from whetstone.envs.tasks.validation_cache import SANDBOX_PLUMBING
        from whetstone.training.checkpoint import MODEL_FILE, checkpoint_step, read_state

        record: dict[str, Any] = {
            "model": str(self.model_dir),
            "model_sha256": self.model_digest,
            "tasks": config.tasks.model_dump(mode="json"),
            "samples": config.samples,
            "seed": config.seed,
            "temperatures": config.evaluated_temperatures,
            "k": config.k,
            "harness": config.harness.model_dump(mode="json"),
            "grading": {
                "sandbox": config.rollout.sandbox.model_dump(mode="json", exclude=SANDBOX_PLUMBING),
                "reward": config.rollout.reward.model_dump(
                    mode="json", exclude={"sandbox": SANDBOX_PLUMBING, "judge": {"timeout_s", "api_key_env"}}
                ),
            },
        }
        if when == "after":
            checkpoint = self.final_checkpoint()
            record["weight_version"] = checkpoint_step(checkpoint)
            record["weights_sha256"] = read_state(checkpoint)["sha256"][MODEL_FILE]
        return record

    @functools.cached_property
    def model_digest(self) -> str:
        """sha256 over the mid-trained model's files (names and contents): an export of the same
        weights reads the same, another model does not. Taken once, after mid-training."""
        return folder_digest(self.model_dir)

    def rl(self) -> dict[str, Any]:
        steps, bound = self.config.rl.steps, self.config.rl.max_wall_time
        self.write_demos()
        trainer_config = self.trainer_config()
        placement = self.config.placement
        ranks = placement.trainer_ranks if self.launcher is None else 1
        if ranks > 1:  # processes of this machine, sharing the trainer's threads
            threads = rank_threads(trainer_config.threads, ranks, len(placement.trainer))
            trainer_config = trainer_config.model_copy(update={"threads": threads})
        trainer = self.start(
            "trainer",
            "trainer",
            trainer_config,
            threads=trainer_config.threads or 1,
            cpus=placement.trainer,
            side="trainer",
            ranks=ranks,
        )
        status = Path(self.orchestrator_config().status_path)
        orchestrator = self.start_orchestrator()
        trainer_metrics = self.run_dir / "trainer" / "metrics.jsonl"
        batch_metrics = self.run_dir / "orchestrator" / "metrics.jsonl"
        done, started, out_of_time, gave_up = 0, time.monotonic(), False, None
        with progress_bar(steps, "rl", "step") as bar:
            while trainer.running:
                time.sleep(1.0)
                if bound and not out_of_time and time.monotonic() - started > bound:
                    out_of_time = True
                    log.info("rl.max_wall_time (%g s) is up: the trainer finishes its step and stops", bound)
                    trainer.stop(grace_s=STOP_GRACE_S)  # it checkpoints and publishes the step it is on
                    continue
                groups = read_json_object(status)
                if not orchestrator.running and groups.get("stopped"):  # it gave up: no more batches come
                    gave_up = str(groups["stopped"])
                    log.warning("the orchestrator stopped (%s): the trainer finishes its step and stops", gave_up)
                    trainer.stop(grace_s=STOP_GRACE_S)
                    continue
                orchestrator.check()  # an orchestrator that failed stops the run with its log
                self.sampler.check()  # and so does a servers.jsonl that cannot be written
                if self.launcher is None:  # and a server that exited (servers Ray lost are left out)
                    self.check_servers_running("during RL")
                step = last_record(trainer_metrics)
                batch = last_record(batch_metrics)
                versions = ",".join(str(int(s.get("weight_version", -1))) for s in self.sampler.latest.values())
                finished = step.get("step", -1) + 1
                bar.update(
                    max(0, finished - done),
                    batch=batch.get("index", "-"),
                    groups=f"{groups.get('groups_kept', 0)}/{groups.get('groups_finished', 0)}",  # kept / finished
                    reward=batch.get("reward_mean", 0.0),
                    kl=step.get("mismatch_kl_k3", 0.0),
                    servers=versions,
                )
                done = max(done, finished)
        self.rl_steps = self.last_trainer_step() if out_of_time or gave_up else steps
        no_step = None
        if self.rl_steps:
            trainer.check()
        else:  # stopped before its first step, the trainer checkpointed nothing (or, killed before it
            # took its stop signal, just ended on it): the run goes on with the mid-trained policy
            no_step = (
                f"the orchestrator stopped: {gave_up}" if gave_up else self.why_no_rl_step(read_json_object(status))
            )
            log.warning("RL made no step: %s", no_step)
        orchestrator.stop()
        if self.rl_steps:
            self.wait_for_version(self.rl_steps)
        from whetstone.run.report import trainer_steps

        logged = read_metrics(trainer_metrics) if trainer_metrics.exists() else []
        records = trainer_steps(logged)  # one per step, as the report counts them
        return {
            "steps": self.rl_steps,
            "steps_planned": steps,
            "stopped_at_wall_time": out_of_time,
            "orchestrator_stopped": gave_up,
            "no_step_reason": no_step,
            "trainer_steps_logged": len(records),
            "trainer_steps_replayed": sum(record.get("replayed") is True for record in logged),
            "reward_first": records[0].get("reward_mean") if records else None,
            "reward_last": records[-1].get("reward_mean") if records else None,
        }

    def start_orchestrator(self) -> RoleProcess:
        """Start the orchestrator, with the servers' token in its environment (`client_environment`)."""
        config = self.orchestrator_config()
        # an earlier start's status: its `stopped` would hide this one's failure
        Path(config.status_path).unlink(missing_ok=True)
        return self.start(
            "orchestrator",
            "orchestrator",
            config,
            threads=1,
            cpus=self.config.placement.orchestrator,
            side="rollout",
            env=self.client_environment(),
        )

    def why_no_rl_step(self, status: dict) -> str:
        """Why RL ended at `rl.max_wall_time` without a step: the orchestrator put no batch 0, the
        one the first step trains on (with its groups' totals, `status`: none finished, or all
        dropped and why), or the trainer did not finish its first step. The batch store says
        which, not the orchestrator's metrics: they keep the records of batches an earlier run
        put in a store emptied since."""
        from whetstone.rl.batch_store import batch_indices, batch_key

        bound = f"{self.config.rl.max_wall_time:g} s"
        orchestrator = self.config.rl.orchestrator
        store = open_store(orchestrator.batch_store, endpoint_url=orchestrator.store_endpoint_url)
        if store.exists(batch_key(0)):
            return (
                f"the trainer did not finish its first step in {bound} ({len(batch_indices(store))} batch(es) put): "
                "raise rl.max_wall_time"
            )
        finished, kept = status.get("groups_finished", 0), status.get("groups_kept", 0)
        if not finished:
            return f"the orchestrator put no batch in {bound}: no group of rollouts finished"
        dropped = ", ".join(f"{reason} {count}" for reason, count in sorted(status.get("rollouts_dropped", {}).items()))
        return (
            f"the orchestrator put no batch in {bound}: {kept} of the {finished} groups that finished had "
            f"something to train on (rollouts dropped: {dropped or 'none'}; no_variance: all solved or all failed)"
        )

    def wait_for_version(self, version: int) -> None:
        """Until every server reports `version` (they follow the store on their own), as sampled."""
        deadline = time.monotonic() + self.config.rl.sync_timeout_s
        while True:
            versions = [sample.get("weight_version") for sample in self.sampler.latest.values()]
            if self.launcher is not None:  # servers Ray lost are not waited for
                live = {role.url for role in self.roles if role.command == "serve" and role.running}
                versions = [s.get("weight_version") for i, s in self.sampler.latest.items() if self.urls[i] in live]
                if versions and all(v == version for v in versions):
                    return
            elif len(versions) == len(self.urls) and all(v == version for v in versions):
                return
            else:  # a server that exited would never get there
                self.check_servers_running(f"before it reached weight version {version}")
            self.sampler.check()
            if time.monotonic() > deadline:
                raise WhetstoneError(
                    f"servers did not reach weight version {version} within "
                    f"{self.config.rl.sync_timeout_s:g} s (they report {versions})"
                )
            time.sleep(0.5)

    def check_servers_running(self, when: str) -> None:
        """Raise, with the end of its log, if a server this machine started has exited (`when`
        says while what): its rollouts fail from then on and it reports no version again, so
        waiting on (a timeout, `rl.max_wall_time`) would only end later, without saying why."""
        for role in self.roles:
            if role.name.startswith("serve-") and role.process is not None and not role.running:
                raise WhetstoneError(
                    f"{role.name} exited (code {role.returncode}) {when}; end of {role.log_path}:\n{role.log_tail()}"
                )

    def server_sampler(self, interval_s: float = 2.0) -> ServerSampler:
        """Samples of the servers' /metrics (`servers.jsonl`) and each side's CPU time (`cpu.jsonl`).
        A sample that cannot be written stops the stage that runs, wherever it waits (an
        evaluation, RL's polling, a role's stop: `interrupt_main`), as a Ctrl-C would, and the run
        ends with why."""
        return ServerSampler(
            self.urls,
            self.run_dir / "servers.jsonl",
            interval_s,
            cpu_groups=self.cpu_groups,
            cpu_path=self.run_dir / "cpu.jsonl",
            tracking=self.config.tracking,
            interrupt_main=True,
        )

    def stop_roles(self) -> signal.Signals | None:
        """Stop every role (the newest first), remove the CPU groups and close the launcher, all of
        it whatever signal comes meanwhile (`Stopping`: a Ctrl-C or SIGTERM during the stop kills
        the roles not stopped yet instead of waiting for them). Returns the first such signal, or
        None. `roles_stopped` is the block that calls it and raises that signal."""
        with Stopping() as stopping:
            for role in reversed(self.roles):
                stopping.stop(role)
            for group in self.cpu_groups.values():
                try:
                    group.remove()
                except WhetstoneError as err:  # a stray process (an orphaned sandbox): the run's results still stand
                    log.warning("%s", err)
            self.cpu_groups.clear()
            if self.launcher is not None:
                self.launcher.close()
        return stopping.first

    @contextlib.contextmanager
    def roles_stopped(self) -> Iterator[None]:
        """Stop the roles (`stop_roles`) when the block ends, however it ends. A signal that came
        while they stopped is raised (`stopped_by`) once they are, unless the block raised: its
        exception is what the run ends with."""
        try:
            yield
        finally:
            interrupted = self.stop_roles()
        if interrupted is not None:
            raise stopped_by(interrupted)

    def newest_trainer_checkpoint(self) -> Path | None:
        from whetstone.training.checkpoint import latest_checkpoint

        return latest_checkpoint(Path(self.config.rl.trainer.output_dir) / "checkpoints")

    def last_trainer_step(self) -> int:
        """The step of the trainer's newest checkpoint (after it stopped early); 0 without one."""
        from whetstone.training.checkpoint import checkpoint_step

        checkpoint = self.newest_trainer_checkpoint()
        return 0 if checkpoint is None else checkpoint_step(checkpoint)

    def final_checkpoint(self) -> Path:
        """The trainer's checkpoint of its last step: the final policy."""
        from whetstone.training.checkpoint import checkpoint_step

        expected = self.config.rl.steps if self.rl_steps is None else self.rl_steps
        checkpoint = self.newest_trainer_checkpoint()
        if checkpoint is None or checkpoint_step(checkpoint) != expected:
            raise WhetstoneError(f"no trainer checkpoint of step {expected} to export (newest: {checkpoint})")
        return checkpoint

    @property
    def rl_trained(self) -> bool:
        """Whether RL changed the policy: the run has an RL stage, and it made a step."""
        return self.config.rl_enabled and self.rl_steps != 0

    def final_logit_scale(self) -> float | None:
        """The logit scale RL learned, as of the final checkpoint (None when it learns none, or
        without an RL step): the final weights' logits are this many times the mid-trained model's."""
        from whetstone.training.checkpoint import read_state

        if not self.rl_trained:
            return None
        scale = read_state(self.final_checkpoint())["data"].get("logit_scale")
        return math.exp(scale["log_scale"]) if scale else None

    def export_policy(self) -> Path:
        """The run's final policy as a Hugging Face folder, `model/` (tokenizer included). After
        RL it is the trainer's last checkpoint, whose weights are the final version the servers
        were evaluated with (the learned logit scale folded into the final norm); without RL, or
        after an RL stage that made no step, it is the mid-trained model."""
        from whetstone.model.hf import load_hf, save_hf
        from whetstone.training.checkpoint import load_weights

        target = self.run_dir / "model"
        if not self.rl_trained:
            with write_errors(target), atomic_directory(target) as tmp:
                shutil.copytree(self.model_dir, tmp, dirs_exist_ok=True)
            return target
        model = load_hf(self.model_dir)  # the architecture; every weight is replaced below
        load_weights(self.final_checkpoint(), model)
        save_hf(model, target, tokenizer_dir=self.model_dir)
        return target

    def yardstick(self, before: dict[str, Any], after: dict[str, Any], logit_scale: float | None) -> dict[str, Any]:
        """The summary's comparison of the two evaluations' temperature sweeps (envs/eval/sweep.py):
        `gain_over_best_temperature` and `gain_scale_frozen` with their paired standard errors,
        and the curves and bests in `temperature_sweep`; None where an evaluation has no sweep
        (a report written before sweeps were recorded)."""
        from whetstone.envs.eval.sweep import compare_sweeps, sweep_of

        before_sweep, after_sweep = sweep_of(before), sweep_of(after)
        if not before_sweep or not after_sweep:
            return dict.fromkeys(YARDSTICK_KEYS)
        evaluated = self.config.eval.evaluated_temperatures
        sweep = compare_sweeps(before_sweep, after_sweep, evaluated, evaluated[0], logit_scale)
        at_best, frozen = sweep["gain_over_best_temperature"], sweep["gain_scale_frozen"]
        return {
            "gain_over_best_temperature": at_best["value"],
            "gain_over_best_temperature_se": at_best["se"],
            "gain_scale_frozen": frozen["value"],
            "gain_scale_frozen_se": frozen["se"],
            "temperature_sweep": sweep,
        }

    def remove_last_results(self) -> None:
        """Remove the `RESULT_FILES` an earlier run left in the run folder: this run writes them
        again when it ends, and should it fail first, they would show that run's results (its
        exported model among them) as its own."""
        for name in RESULT_FILES:
            path = self.run_dir / name
            with write_errors(path):
                if path.is_dir() and not path.is_symlink():
                    shutil.rmtree(path)
                else:
                    path.unlink(missing_ok=True)

    def run(self) -> dict[str, Any]:
        from whetstone.run.preflight import check_run_config

        config = self.config
        check_run_config(config)  # every path, task source and core, before mid-training
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.remove_last_results()
        self.write_config()
        started = time.time()
        summary: dict[str, Any] = {
            "run_dir": str(self.run_dir),
            "heldout_pass1_before": None,
            "heldout_pass1_after": None,
            "headline_temperature": config.eval.harness.sampling.temperature,
            "final_logit_scale": None,
            **dict.fromkeys(YARDSTICK_KEYS),
        }
        with self.roles_stopped():  # and the CPU groups, made in the block so that no failure leaves them
            self.open_cpu_groups()  # a quota that cannot be set stops the run before mid-training
            stages: dict[str, Any] = {"midtrain": self.midtrain()}
            if config.rl_enabled:
                self.check_rl_model()  # before the servers load the weight store's newest version
                self.start_servers()
                with self.server_sampler() as self.sampler:
                    before = self.evaluate("before")
                    summary["heldout_pass1_before"] = before["pass_at_k"]["1"]
                    stages["rl"] = self.rl()
                    if self.rl_trained:  # else the final policy is the one evaluated before
                        summary["final_logit_scale"] = scale = self.final_logit_scale()
                        after = self.evaluate("after", scale)
                        summary["heldout_pass1_after"] = after["pass_at_k"]["1"]
                        summary.update(self.yardstick(before, after, scale))
        model = self.export_policy()
        summary.update(
            model=str(model),
            wall_s=time.time() - started,
            stages=stages,
            config=without_secrets(self.config.model_dump(mode="json")),  # config.toml (private) keeps them
        )
        with write_errors(self.run_dir / "summary.json"):
            atomic_write_json(self.run_dir / "summary.json", summary)
        from whetstone.run.report import write_report

        summary["report"] = str(write_report(self.run_dir))
        return summary


def run_pipeline(config: PipelineConfig) -> dict[str, Any]:
    return Pipeline(config).run()


LATER_RECORD_KEYS = ("k", "harness", "grading")
"""What an evaluation's record (`Pipeline.evaluated`) holds since a later whetstone than its
first: a record without any of them is matched on the rest, so a run resumed across the upgrade
is not evaluated again (nor, past RL's first step, stopped for it)."""


def same_evaluation(recorded: dict[str, Any], evaluated: dict[str, Any]) -> bool:
    """Whether the record `recorded` (read from a report's folder) is of the evaluation `evaluated`."""
    if recorded == evaluated:
        return True
    if not recorded or any(key in recorded for key in LATER_RECORD_KEYS):
        return False
    return recorded == {key: value for key, value in evaluated.items() if key not in LATER_RECORD_KEYS}


def _holds_something(location: str, endpoint_url: str | None) -> bool:
    """Whether `location` (a folder, or a store's URL) holds anything: a store opened and left
    empty holds nothing."""
    if location.startswith("s3://"):
        try:
            return bool(open_store(location, endpoint_url=endpoint_url).list())
        except Exception as err:  # unreadable from here (a cluster's bucket): the check passes it by, saying so
            log.warning("could not look into %s for RL state: %s: %s", location, type(err).__name__, err)
            return False
    path = Path(location.removeprefix("file://"))
    return path.is_file() or (path.is_dir() and any(path.iterdir()))


def _written_since(path: Path, before: os.stat_result | None) -> bool:
    """Whether `path` holds records written since `before` (its state then, or None if it held
    none): it grew, or it is another file (rewritten)."""
    try:
        now = path.stat()
    except FileNotFoundError:
        return False
    return before is None or now.st_ino != before.st_ino or now.st_size > before.st_size
