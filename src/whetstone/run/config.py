"""The `whetstone run` config: its defaults are the default run (docs/run.md).

The role sections (`servers.serve`, `rl.trainer`, `rl.orchestrator`, `eval`) are the roles' own
configs. `PipelineConfig.resolved` ties them together: the top-level `harness` and `tracking`
replace theirs, `rl.steps`, the trainer's weight sync and the roles' devices (`placement`) are
passed on, and every path and address (model folder, weight and batch stores, server URLs, output
folders, tokenizer) is filled in from the run folder, so what those fields held is ignored, as is
the clients' `endpoint.api_key_env` when the servers take a token; everything else is used as
written.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, TypeAdapter, ValidationError, field_validator, model_validator

from whetstone.config import Config, FolderName, expand_path, format_validation_error
from whetstone.data import CorpusConfig
from whetstone.envs.eval.config import EvalConfig
from whetstone.envs.harness import HarnessConfig, RolloutConfig
from whetstone.envs.tasks import TasksConfig
from whetstone.envs.tasks.synth import SynthConfig
from whetstone.errors import ConfigError
from whetstone.inference.config import EngineConfig, ServeConfig
from whetstone.integrations.vllm_serve import LAUNCHER_FLAGS, PAUSE_LIMIT_S, vllm_flag
from whetstone.midtrain.config import MidtrainConfig, RunConfig
from whetstone.orchestrator.config import OrchestratorConfig
from whetstone.rl.advantages import AdvantageConfig
from whetstone.rl.loss import LossConfig
from whetstone.run.ray_launch import RayConfig
from whetstone.trainer.config import TrainerConfig
from whetstone.training.config import OptimizerConfig
from whetstone.utils.device import DeviceName
from whetstone.utils.tracking import TrackingConfig

DEVICE_NAME = TypeAdapter(DeviceName)
"""Checks one device name as a `DeviceName` field does (for a list of them)."""
SERVER_TOKEN_ENV = "WHETSTONE_RUN_SERVER_TOKEN"
"""The environment variable through which the run's clients of its servers (the orchestrator, the
evaluations) get `servers.serve.auth_token`: their `endpoint.api_key_env` names it, and only their
processes have it (`Pipeline.client_environment`): no client's config file holds the token."""


class ServersConfig(Config):
    """The inference servers the pipeline starts (on this machine, or on Ray: `placement`)."""

    count: int = Field(2, ge=1)
    """Number of server processes."""
    base_port: int = Field(0, ge=0, le=65535)
    """Server i listens on base_port + i; 0 = free ports picked at start."""
    serve: ServeConfig = ServeConfig(threads=1, engine=EngineConfig(max_batch=16))
    """Settings of every server (model_path, port, sync and `engine.device` are set by the
    pipeline; the device from `placement.server_devices`). With an `auth_token`, the run's
    orchestrator and evaluations send it: their `endpoint.api_key_env` is set to
    `SERVER_TOKEN_ENV`, which only their processes have."""
    start_timeout_s: float = Field(180.0, gt=0)
    """Give up when a server is not healthy this long after its start."""
    engine: Literal["whetstone", "vllm"] = "whetstone"
    """The servers' engine: `whetstone serve`, or vLLM OpenAI servers that follow the weight store
    through whetstone's worker extension (docs/vllm.md); the orchestrator and the evaluations speak
    its protocol. `serve` settings other than `engine.device` apply to whetstone's engine only."""
    vllm_python: str = ""
    """With `engine = "vllm"`: the python of the virtual environment vLLM is installed in; empty =
    $WHETSTONE_VLLM_PYTHON. On Ray, the same path on every node that takes a server."""
    vllm_args: list[str] = []
    """With `engine = "vllm"`: more arguments for vLLM's server (e.g. `["--max-num-seqs", "16"]`)."""
    vllm_pause_limit_s: float = Field(PAUSE_LIMIT_S, gt=0)
    """With `engine = "vllm"`: seconds failed weight swaps may keep vLLM paused before the server stops."""

    @model_validator(mode="after")
    def _vllm_takes_no_token(self) -> "ServersConfig":
        # vLLM is started without --api-key, and whetstone's own calls to it (weight swaps, health,
        # /inference/v1/generate) send no key: its servers would serve whoever reaches them
        if self.engine == "vllm" and self.serve.auth_token:
            raise ValueError(
                "serve.auth_token is set with engine = 'vllm', but whetstone starts vLLM's servers without "
                "a key (no --api-key) and its weight swaps and clients call them without one: they would "
                "answer anyone. Leave serve.auth_token empty and keep vLLM's servers on a trusted network "
                "(their VLLM_SERVER_DEV_MODE routes are open too, docs/vllm.md), or use engine = 'whetstone'"
            )
        return self

    @field_validator("vllm_args")
    @classmethod
    def _no_launcher_option(cls, args: list[str]) -> list[str]:
        """Options the launcher sets itself, refused here rather than by each server as it starts."""
        for flag in (vllm_flag(arg) for arg in args):
            if flag in LAUNCHER_FLAGS:
                raise ValueError(
                    f"{flag}: whetstone sets it for each vLLM server itself (host and port from base_port, the "
                    "model from the run, the logprobs the trainer computes); leave it out"
                )
        return args

    @model_validator(mode="after")
    def _ports_exist(self) -> "ServersConfig":
        last = self.base_port + self.count - 1
        if self.base_port and last > 65535:
            raise ValueError(
                f"base_port {self.base_port} + count {self.count} - 1 = port {last}, past 65535: "
                f"lower base_port to {65536 - self.count} or less"
            )
        return self


class RLConfig(Config):
    """Stage 2: asynchronous RL with the trainer, the servers and the orchestrator as processes."""

    steps: int = Field(28, ge=1)
    """Optimizer steps (= batches) of the RL stage: the held-out gain grew with steps (+1.5 at 16
    steps of 1e-4, +6.5 at 64), and 28 fit the default run into 15 minutes (figures:
    docs/experiments.md)."""
    max_wall_time: float = Field(0.0, ge=0)
    """Seconds of RL after which the trainer is told to stop (as on SIGTERM: it finishes the step
    it is on, checkpoints and publishes it), and the run evaluates and exports that step's policy
    (the mid-trained one if no step was made); 0 = run all `steps`. Bounds a run whose steps'
    speed is not known beforehand."""
    trainer: TrainerConfig = TrainerConfig(
        checkpoint_interval=4,
        optimizer=OptimizerConfig(lr=3e-4, warmup_steps=0, min_lr_ratio=1.0, weight_decay=0.0),
        optimizer_steps_per_batch=4,
        loss=LossConfig(aggregation="sequence"),
        logit_scale_lr=0.03,
        demo_coef=4.0,
    )
    """The trainer (its paths are set by the pipeline; `max_steps` = `steps`): four optimizer
    steps per batch; a per-sample loss mean, since failed rollouts ramble and under a token mean
    outweigh the solved ones; the learned logit scale (`logit_scale_lr`, rl/logit_scale.py), so
    that sharpening costs the weights nothing; weights at 3e-4, which on the two- and three-step
    held-out set gained more per step than 1e-4; and 8 mid-training demonstrations fitted at
    every optimizer step (`demo_coef` 4, `rl.demos`), which keeps RL from breaking the tasks it
    does not train on. Figures behind each value: docs/experiments.md."""
    orchestrator: OrchestratorConfig = OrchestratorConfig(
        tasks=TasksConfig(synth=SynthConfig(count=400, split="train", seed=1, min_difficulty=2, difficulty=3)),
        rollout=RolloutConfig(concurrency=12),
        group_size=8,
        groups_per_batch=4,
        advantages=AdvantageConfig(negative_weight=0.2),
    )
    """The orchestrator (its servers, stores and metrics path are set by the pipeline). RL trains on
    two- and three-step train tasks, the step counts of the held-out set (one-step tasks came
    back all solved and dropped more often, so batches waited longer). Negative advantages count
    a fifth (`advantages.negative_weight`):
    pushing down the sampled tokens of failed rollouts spreads probability over the rest, which
    at ~400 rollouts outweighs what RL teaches (docs/experiments.md)."""
    sync_timeout_s: float = Field(120.0, gt=0)
    """After the last step, how long the servers may take to load the final version."""


class PlacementConfig(Config):
    """Where each role runs: its device (a GPU, or the CPU) and the CPU cores it may use (empty =
    any core). On one machine, disjoint cores stand in for roles on separate hardware (trainer
    GPUs, inference GPUs), as the pipeline benchmark places them; sharing every core is what
    serves one small machine best. On one GPU the trainer and the servers share it, each held to
    its share of the GPU's memory (`trainer_memory_fraction`)."""

    trainer_device: DeviceName = "auto"
    """Device of the RL trainer (`rl.trainer.device`): `auto` (CUDA when present, else the CPU),
    `cpu`, `cuda` or `cuda:N`."""
    server_devices: list[str] = Field(["auto"], min_length=1)
    """Device of each inference server (its `engine.device`): server i takes entry i modulo the
    list's length, so one entry places every server, and `["cuda:1", "cuda:2"]` puts two servers
    on GPUs of their own."""
    trainer_memory_fraction: float = Field(0.5, gt=0.0, lt=1.0)
    """Share of a GPU's memory the trainer may allocate when it shares that GPU with servers; the
    servers on it split the rest equally. Roles alone on a GPU may use all of it."""

    @field_validator("server_devices")
    @classmethod
    def _device_names(cls, names: list[str]) -> list[str]:
        for name in names:
            try:
                DEVICE_NAME.validate_python(name)
            except ValidationError as err:
                raise ValueError(str(err.errors()[0]["ctx"]["error"])) from None
        return names

    trainer: list[int] = []
    """Cores of the trainer process."""
    servers: list[int] = []
    """Cores of every inference server."""
    orchestrator: list[int] = []
    """Cores of the orchestrator and the sandboxes its rollouts run."""
    trainer_cores: float = Field(0.0, ge=0.0)
    """CPU time the trainer may use, in cores (a cgroup CPU quota, `utils.cgroups`, enforced
    every 10 ms; 0 = no quota). Quotas size each side by its share of the work, as hardware would
    be sized."""
    rollout_cores: float = Field(0.0, ge=0.0)
    """CPU time the servers, the orchestrator and its sandboxes may use together, in cores
    (a cgroup CPU quota; 0 = no quota)."""
    trainer_ranks: int = Field(1, ge=1)
    """Trainer processes on this machine (`backend = "local"`), the ranks of one FSDP2 job as
    torchrun would start them (`run/local_ranks.py`): on GPUs (`trainer_device` `cuda` or `auto`)
    rank i computes on cuda:i, so the servers go on the GPUs after them (`server_devices`); on the
    CPU they are gloo ranks sharing the trainer's cores and threads. On Ray:
    `ray.trainer_ranks`."""
    midtrain_ranks: int = Field(1, ge=1)
    """Mid-training processes on this machine (`backend = "local"`), as `trainer_ranks`, instead
    of mid-training in the process of `whetstone run`: rank i on cuda:i (`midtrain.run.device`
    `cuda` or `auto`), or gloo ranks on the CPU. On Ray: `ray.midtrain_ranks`."""
    backend: Literal["local", "ray"] = "local"
    """`local`: every role a process of this machine. `ray`: the trainer, the servers and the
    orchestrator as Ray actors on a cluster (`ray`; docs/cluster.md); the cores, quotas and
    memory shares above apply only to `local`."""
    ray: RayConfig = RayConfig()
    """The Ray cluster and what each role asks of it (with `backend = "ray"`)."""


class PipelineConfig(Config):
    """`whetstone run`: every stage of a run, written under `<output_dir>/<name>/`."""

    name: FolderName = "default"
    """Run name: outputs go to `<output_dir>/<name>/`."""
    output_dir: str = "runs"
    """Parent directory of run folders."""
    demos: SynthConfig = SynthConfig(count=4000, split="train", difficulty=3)
    """Synth train tasks whose solved transcripts are mixed into mid-training (train split only):
    one to three steps, so that the base writes three-step solutions at all (with demonstrations
    of at most two steps it solved no three-step task) and RL gets groups that are not all failed."""
    demo_recovery: float = Field(0.0, ge=0.0, le=1.0)
    """Share of those transcripts that open with a failed attempt (of `demo_recovery_attempt`'s
    kind, masked from the loss) and its real test output, then the fix: without them the model
    had never seen a failing test and, after its own wrong first attempt, wrote garbage until
    `max_turns`. With them it rewrites the file, but no retry passed in the runs measured
    (docs/experiments.md), hence off."""
    demo_recovery_attempt: Literal["slip", "misread"] = "slip"
    """The failed attempt a recovery transcript opens with: `slip`, one token of the reference
    changed, or `misread`, another task's solution (the instruction read wrong; envs/tasks/
    demonstrations.py)."""
    midtrain: MidtrainConfig = MidtrainConfig(
        data=CorpusConfig(demo_weight=0.8, seq_len=384),
        optimizer=OptimizerConfig(lr=6e-3),
        run=RunConfig(steps=3000, max_wall_time=0),
    )
    """Stage 1: mid-training on the code corpus plus the demonstrations (most rows are
    demonstrations, each row long enough for one whole transcript). 3000 steps: the model learns
    to read the instruction late (~2% held-out pass@1 at 700 steps, ~48% at 2000), and fewer steps
    leave the base at the mercy of the machine's rounding. On a slow CPU lower `run.steps`
    (timings: docs/run.md)."""
    harness: HarnessConfig = HarnessConfig(
        max_turns=4,
        max_turn_tokens=160,
        max_tool_tokens=256,
        summary_tokens=64,
        train_cut_off_calls=True,
    )
    """The agent loop of every rollout, in RL and in both evaluations (the same on purpose). Calls
    cut off by the token budget are trained: masked, their rambling was never penalised and RL
    collapsed into it (measured: held-out pass@1 0.425 -> 0.017)."""
    servers: ServersConfig = ServersConfig()
    """The inference servers (shared by both evaluations and RL)."""
    rl: RLConfig = RLConfig()
    """Stage 2: asynchronous RL."""
    eval: EvalConfig = EvalConfig(
        tasks=TasksConfig(synth=SynthConfig(split="heldout", count=200, seed=0, min_difficulty=2, difficulty=3)),
        samples=2,
        k=[1, 2],
        temperatures=[1.0, 0.5, 0.2],
        rollout=RolloutConfig(concurrency=32),
    )
    """Held-out evaluation before and after RL (endpoint, harness and output folder are set by
    the pipeline): 200 tasks of two and three steps x 2 rollouts, ~40 s on 2 cores at each
    temperature. Tasks with room to learn: the base solves about 0.4 of them at its best
    temperature (one- and two-step tasks it mostly solves once sampled sharply, leaving RL little
    to add beyond the temperature). Held-out tasks are unseen compositions of the primitives RL
    trains on (synth.py). A smaller set flattered or hid RL's gain by several points. Three
    temperatures find each model's best within about a point (docs/run.md, the yardstick); 32
    rollouts in flight fill both servers' batches, a fifth less CPU per rollout than 12."""
    placement: PlacementConfig = PlacementConfig()
    """Devices, GPU memory shares and CPU cores of the roles the pipeline starts (evaluations run
    in the pipeline's own process; mid-training too, on `midtrain.run.device`)."""
    rl_enabled: bool = True
    """Run stage 2 (RL, with both evaluations); off = mid-training only."""
    tracking: TrackingConfig = TrackingConfig()
    """Where every role's metrics go besides its metrics.jsonl: TensorBoard (on), Weights & Biases
    (off). It replaces the roles' own sections, with `dir` = the run folder and `wandb_group` =
    `name`: event files in `tensorboard/<role>/`, one W&B run per role, grouped."""

    @model_validator(mode="after")
    def _anchor_has_demos(self) -> "PipelineConfig":
        trainer = self.rl.trainer
        if self.rl_enabled and trainer.demo_coef > 0 and not trainer.demos_path and not self.demos.count:
            raise ValueError(
                "rl.trainer.demo_coef > 0 anchors RL to the mid-training demonstrations, but demos.count "
                "is 0: set demos.count or rl.trainer.demos_path"
            )
        return self

    @model_validator(mode="after")
    def _eval_reports_pass_at_1(self) -> "PipelineConfig":
        # summary.json's held-out gain, the report and the plots are pass@1 before and after RL
        if self.rl_enabled and 1 not in self.eval.k:
            raise ValueError(
                f"eval.k = {self.eval.k} must include 1: the run reports held-out pass@1 before and after RL"
            )
        return self

    @model_validator(mode="after")
    def _invariant_on_both_sides(self) -> "PipelineConfig":
        # Batch-invariant kernels on one side only still leave the other side's rounding.
        trainer, engine = self.rl.trainer, self.servers.serve.engine
        if "invariant" in (trainer.numerics, engine.numerics) and (trainer.numerics, trainer.dtype) != (
            engine.numerics,
            engine.dtype,
        ):
            raise ValueError(
                "numerics = 'invariant' makes the trainer's logprobs the servers' only with the same numerics "
                f"and dtype on both sides: rl.trainer has ({trainer.numerics!r}, {trainer.dtype!r}), "
                f"servers.serve.engine has ({engine.numerics!r}, {engine.dtype!r})"
            )
        return self

    @model_validator(mode="after")
    def _ranks(self) -> "PipelineConfig":
        # local ranks: this machine's GPUs, in order; mid-training's (local or on Ray): a share of its batch each
        placement = self.placement
        ranks = (("trainer", placement.trainer_device), ("midtrain", self.midtrain.run.device))
        for role, device in ranks:
            count = getattr(placement, f"{role}_ranks")
            if count == 1:
                continue
            if placement.backend == "ray":
                raise ValueError(
                    f"placement.{role}_ranks = {count} places ranks on this machine (backend 'local'); "
                    f"on Ray: placement.ray.{role}_ranks"
                )
            if device.startswith("cuda:"):
                key = "placement.trainer_device" if role == "trainer" else "midtrain.run.device"
                raise ValueError(
                    f"{key} = {device!r} with placement.{role}_ranks = {count}: rank i computes on cuda:i; "
                    "use 'cuda' or 'auto'"
                )
        on_ray = placement.backend == "ray" and placement.ray.midtrain is not None
        key = "placement.ray.midtrain_ranks" if on_ray else "placement.midtrain_ranks"
        ranks, batch = (placement.ray if on_ray else placement).midtrain_ranks, self.midtrain.run.batch_size
        if batch % ranks:  # else each rank would refuse it, once started (`midtrain/setup.py`)
            raise ValueError(
                f"midtrain.run.batch_size ({batch}) must be a multiple of {key} ({ranks}): each rank "
                "trains an equal share of every micro-batch's rows"
            )
        return self

    @model_validator(mode="after")
    def _ray_places_the_gpus(self) -> "PipelineConfig":
        # On Ray a role's process sees only the GPUs its actor got (`ray_launch.gpu_environment`)
        placement = self.placement
        if placement.backend != "ray":
            return self
        asks = {"trainer": placement.ray.trainer.num_gpus, "server": placement.ray.server.num_gpus}
        devices = [("trainer", "placement.trainer_device", placement.trainer_device)]
        if placement.ray.midtrain is not None:  # on the cluster too
            asks["midtrain"] = placement.ray.midtrain.num_gpus
            devices.append(("midtrain", "midtrain.run.device", self.midtrain.run.device))
        devices += [
            ("server", f"placement.server_devices[{i}]", name) for i, name in enumerate(placement.server_devices)
        ]
        for role, key, name in devices:
            if name.startswith("cuda:"):
                raise ValueError(
                    f"{key} = {name!r} with placement.backend = 'ray': Ray assigns the GPUs (a role sees "
                    f"its own as cuda:0); use 'cuda' or 'auto' and placement.ray.{role}.num_gpus"
                )
            if name == "cuda" and not asks[role]:
                raise ValueError(f"{key} = 'cuda' with placement.ray.{role}.num_gpus = 0: Ray gives the role no GPU")
        return self

    @property
    def run_dir(self) -> Path:
        """The run folder, `<output_dir>/<name>` (`~` and `$NAME` expanded: `expand_path`)."""
        return expand_path(self.output_dir) / self.name

    def resolved(self, servers: list[str] | None = None) -> PipelineConfig:
        """The config as the stages run it; the pipeline runs this one and writes it to
        `config.toml`, and resolving it again changes nothing. The top-level `harness` (with the
        mid-trained model's tokenizer) is the harness of RL and of both evaluations; `rl.steps` is
        the trainer's `max_steps` and the orchestrator's `max_batches` and `total_batches`; the trainer's weight sync
        is every server's; every path is under the run folder (the evaluations write to
        `eval.output_dir`/before and /after). `servers`: the API roots of the started servers,
        for the orchestrator and the evaluations; with `servers.serve.auth_token`, their
        endpoints' `api_key_env` is `SERVER_TOKEN_ENV`. A section that does not validate once they are
        applied (e.g. a top-level harness sampling at temperature 0, which RL refuses) raises a
        `ConfigError` naming it."""
        run_dir = self.run_dir
        model = str(run_dir / "midtrain" / "model")
        data = self.model_dump(mode="json")
        data["harness"]["tokenizer_path"] = model
        sync = {**data["rl"]["trainer"]["sync"], "store": str(run_dir / "weights")}
        if self.placement.backend == "ray":  # the clusters' stores, each a mirror of the run's
            sync["mirrors"] = list(self.placement.ray.cluster_stores.values())
        data["midtrain"]["run"].update(output_dir=str(run_dir), name="midtrain")
        data["servers"]["serve"].update(model_path=model, sync=sync, weight_version=0)
        data["rl"]["trainer"].update(
            model_path=model,
            batch_store=str(run_dir / "batches"),
            sync=sync,
            output_dir=str(run_dir / "trainer"),
            max_steps=self.rl.steps,
            idle_timeout=0.0,
            device=self.placement.trainer_device,
        )
        data["rl"]["orchestrator"].update(
            harness=data["harness"],
            batch_store=str(run_dir / "batches"),
            weight_store=str(run_dir / "weights"),
            max_batches=self.rl.steps,
            total_batches=self.rl.steps,
            metrics_path=str(run_dir / "orchestrator" / "metrics.jsonl"),
            status_path=str(run_dir / "orchestrator" / "status.json"),
        )
        data["tracking"].update(dir=str(run_dir), wandb_group=self.name)
        for role in (data["midtrain"], data["rl"]["trainer"], data["rl"]["orchestrator"]):
            role["tracking"] = data["tracking"]
        data["eval"].update(harness=data["harness"], output_dir=str(run_dir / "eval"))
        data["eval"]["tasks"]["validation_cache"] = str(run_dir / "eval" / "validation.json")
        if servers is not None:
            data["rl"]["orchestrator"]["servers"] = data["eval"]["servers"] = list(servers)
        for role in (data["rl"]["orchestrator"], data["eval"]):
            role["endpoint"]["engine"] = self.servers.engine
            if self.servers.serve.auth_token:  # the servers' token, in the clients' environment only
                role["endpoint"]["api_key_env"] = SERVER_TOKEN_ENV
        try:
            return type(self).model_validate(data)
        except ValidationError as err:
            raise ConfigError(
                format_validation_error(err, "the run config with its top-level sections applied")
            ) from None
