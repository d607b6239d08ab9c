"""`whetstone run` on a Ray cluster (`placement.backend = "ray"`): each role is the same process
as on one machine (`whetstone serve|trainer|orchestrator <role>.toml`), started by a Ray actor
(`RoleActor`) on a node with the resources the role asks for (`placement.ray`).

    trainer       one actor, `ray.trainer` CPUs/GPUs, restarted by Ray if it dies
                  (`ray.role_restarts`), resuming from its checkpoint; or, with
                  `ray.trainer_ranks` > 1, one actor per torch.distributed rank, each on a bundle
                  of one placement group (`run/ray_ranks.py`), the group restarted whole when a
                  rank is lost
    servers       one actor each, `ray.server` CPUs/GPUs, running `whetstone serve` or, with
                  `servers.engine = "vllm"`, a vLLM server (`integrations.vllm_serve`, with the
                  python `servers.vllm_python` names, at that path on every node); server i's cluster label
                  (`ray.server_clusters`) is also the custom resource `cluster:<label>` the node
                  must offer (`ray start --resources '{"cluster:eu": 8}'`); each listens on a free
                  port of its node, follows its cluster's weight store (`ray.cluster_stores`, a
                  mirror the trainer copies every version into) and announces itself in the run
                  weight store's fleet registry
    orchestrator  one actor, `ray.orchestrator` CPUs; it finds the servers in the registry
                  (`discover_servers`), so servers Ray restarts elsewhere join by themselves;
                  restarted by Ray if it dies, at the next batch index
    midtrain      with `ray.midtrain` set, `ray.midtrain_ranks` actors with those resources
                  each (one placement group, as the trainer's ranks), running `whetstone run
                  --midtrain-only` of the run's config, rank 0's output in logs/midtrain.log;
                  else in the process of `whetstone run`

Each role's process sees exactly the GPUs Ray gave its actor (`gpu_environment`).

The run folder must be a directory every node sees (role configs, logs, the mid-trained model,
checkpoints); the weight and batch stores are there too, or on S3. A role's process ends with its
actor (the kernel's parent-death signal), so killing an actor is killing the role. Ray is the
optional extra `whetstone[ray]`; nothing here imports it until a Ray run starts.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Literal

from pydantic import Field

from whetstone.config import Config, dump_toml
from whetstone.errors import ConfigError, WhetstoneError
from whetstone.fleet.config import CLUSTER_PATTERN
from whetstone.fleet.registry import api_root
from whetstone.utils.atomic import PRIVATE, atomic_write_text
from whetstone.utils.processes import (
    GPU_MEMORY_ENV,
    RoleProcess,
    Stopping,
    free_port,
    keep_sigterm_raising,
    stopped_by,
    wait_polling,
)

PREDECESSOR_GRACE_S = 60.0
"""How long a restarted role waits for its predecessor's process to end before killing it."""


class RoleResources(Config):
    num_cpus: float = Field(1.0, ge=0)
    """CPU cores Ray reserves for the role on its node."""
    num_gpus: float = Field(0.0, ge=0)
    """GPUs Ray reserves for the role, which sees only those (CUDA_VISIBLE_DEVICES; none with 0,
    so `auto` is the CPU). A fraction shares a GPU with other roles, each held to that share of
    its memory. At most 1: a role's process computes on one GPU (several: `trainer_ranks`)."""

    def bundle(self) -> dict[str, float]:
        """These resources as a placement group bundle (what is 0 left out)."""
        return {kind: amount for kind, amount in (("CPU", self.num_cpus), ("GPU", self.num_gpus)) if amount}


class RayConfig(Config):
    """Where `placement.backend = "ray"` puts the roles."""

    address: str = ""
    """The Ray cluster to join (`host:6379`, `ray://host:10001`); empty = `RAY_ADDRESS`, else a
    Ray instance started on this machine for the run."""
    trainer: RoleResources = RoleResources()
    """Resources of the trainer (of each of its ranks, with `trainer_ranks` > 1)."""
    trainer_ranks: int = Field(1, ge=1)
    """Trainer processes, the torch.distributed ranks of one FSDP2 job (gloo on CPUs, NCCL on
    GPUs): each a Ray actor on its own bundle (`trainer` resources; num_gpus 0 or 1) of one
    placement group. A rank that is lost stops and restarts the whole group (`role_restarts`
    times), which resumes from the newest checkpoint. 1 = one trainer process."""
    trainer_strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = "PACK"
    """How the ranks' bundles spread over nodes (Ray's placement group strategies): `PACK` as
    few nodes as fit (NVLink between a node's GPUs), `STRICT_SPREAD` one rank per node."""
    server: RoleResources = RoleResources()
    """Resources of every inference server."""
    orchestrator: RoleResources = RoleResources()
    """Resources of the orchestrator (its sandboxes run on its node)."""
    midtrain: RoleResources | None = None
    """Where mid-training runs: unset, in the process of `whetstone run` (on that machine's
    device); set (e.g. `{ num_cpus = 8, num_gpus = 1 }`), on the cluster, each of its
    `midtrain_ranks` processes on a node that offers these resources, rank 0's output in
    `logs/midtrain.log`."""
    midtrain_ranks: int = Field(1, ge=1)
    """Mid-training processes with `midtrain` set: the torch.distributed ranks of one FSDP2 job,
    placed and restarted as the trainer's ranks are (`trainer_ranks`); a restarted group resumes
    from mid-training's newest checkpoint."""
    midtrain_strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = "PACK"
    """How mid-training's ranks spread over nodes (as `trainer_strategy`)."""
    server_clusters: list[str] = Field(["default"], min_length=1)
    """Cluster label of server i (entry i modulo the list's length). A label other than
    `default` also places the server: only on nodes offering the resource `cluster:<label>`."""
    cluster_stores: dict[str, str] = {}
    """Weight store of each cluster label (a directory every node of that cluster sees, or
    s3://bucket/prefix, e.g. a bucket in its region): the trainer copies every version into each
    (`sync.mirrors`), and that cluster's servers follow it. A cluster not named here follows the
    run's weight store. The fleet registry stays in the run's weight store."""
    place_timeout_s: float = Field(300.0, gt=0)
    """Give up when a role's actor is not placed and started this long after it was asked for
    (no node offers its resources, e.g. a cluster label no node has)."""
    server_restarts: int = Field(3, ge=0)
    """Times Ray restarts a server whose actor died (on a free port, perhaps on another node; it
    catches up through the weight store and announces itself again)."""

    role_restarts: int = Field(3, ge=0)
    """Times Ray restarts the trainer's or the orchestrator's actor that died (its node lost, the
    actor killed), or a group of ranks that lost one (the trainer's, mid-training's): the role
    starts again and resumes, the trainer from its checkpoint (replaying the batches after it),
    mid-training from its newest checkpoint, the orchestrator at the next batch index; no batch is
    lost or trained twice. A role whose process exits with an error is not restarted: the run
    stops with its log."""

    def cluster_of(self, index: int) -> str:
        return self.server_clusters[index % len(self.server_clusters)]

    def model_post_init(self, context) -> None:
        import re

        for label in self.server_clusters:
            if not re.match(CLUSTER_PATTERN, label):
                raise ValueError(f"server_clusters: {label!r} is not a plain label (letters, digits, _ . -)")
        unknown = sorted(set(self.cluster_stores) - set(self.server_clusters))
        if unknown:
            raise ValueError(f"cluster_stores names clusters no server is in: {unknown} (server_clusters)")
        if self.trainer_ranks > 1 and self.trainer.num_gpus not in (0, 1):
            raise ValueError(
                f"trainer.num_gpus = {self.trainer.num_gpus:g} with trainer_ranks = {self.trainer_ranks}: "
                "each rank takes one whole GPU (1) or none (0)"
            )
        if self.trainer_ranks > 1 and self.trainer.num_cpus == 0 and self.trainer.num_gpus == 0:
            raise ValueError("trainer_ranks > 1 needs trainer.num_cpus or trainer.num_gpus > 0 (a rank's bundle)")
        if self.midtrain is None and self.midtrain_ranks > 1:
            raise ValueError("midtrain_ranks > 1 needs midtrain: the resources of each rank")
        if self.midtrain is not None and self.midtrain.num_cpus == 0 and self.midtrain.num_gpus == 0:
            raise ValueError("midtrain needs num_cpus or num_gpus > 0 (the node reserved for it)")
        if self.midtrain is not None and self.midtrain_ranks > 1 and self.midtrain.num_gpus not in (0, 1):
            raise ValueError(
                f"midtrain.num_gpus = {self.midtrain.num_gpus:g} with midtrain_ranks = {self.midtrain_ranks}: "
                "each rank takes one whole GPU (1) or none (0)"
            )
        for role in ("trainer", "server", "orchestrator", "midtrain"):
            if getattr(self, role) is not None and getattr(self, role).num_gpus > 1:
                more = " (trainer_ranks = N: N processes of one GPU each)" if role == "trainer" else ""
                raise ValueError(
                    f"{role}.num_gpus = {getattr(self, role).num_gpus:g}: a role's process computes on one "
                    f"GPU, the rest would sit reserved and idle{more}"
                )


def import_ray():
    try:
        import ray
    except ImportError:
        raise ConfigError("placement.backend = 'ray' needs Ray: pip install 'whetstone[ray]' on every node") from None
    return ray


def gpu_environment(num_gpus: float) -> dict[str, str]:
    """The environment that gives a role's process (in an actor that asked for `num_gpus`)
    exactly the GPUs Ray assigned it, whatever Ray itself set: CUDA_VISIBLE_DEVICES listing them,
    empty for none (Ray leaves it unset for an actor without GPUs in recent versions, and for
    every actor under RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES: the process would see every
    GPU of the node); and for a fraction of one GPU, that share of its memory (as roles sharing a
    GPU on one machine get, `utils.processes.limit_gpu_memory`)."""
    import ray

    gpus = [str(gpu) for gpu in ray.get_gpu_ids()]
    env = {"CUDA_VISIBLE_DEVICES": ",".join(gpus)}
    if gpus and 0 < num_gpus < 1:
        env[GPU_MEMORY_ENV] = f"cuda:0={num_gpus:.6g}"
    return env


def wait_for_predecessor(pid_path: Path, grace_s: float = PREDECESSOR_GRACE_S) -> None:
    """Before a restarted actor starts its role again: wait for the processes of the actor it
    replaces to end, if they run on this node (`pid_path`, written by `record_role`: the role's
    process group). The role's process got SIGTERM when its actor died and may still be finishing
    a step and checkpointing (a trainer) or writing a batch (an orchestrator): two at once would
    race for the same versions and batches. The processes it started count too: a vLLM server's
    engine core holds its GPU memory until it has exited. All are killed after `grace_s`."""
    try:
        host, pid, started = pid_path.read_text().split()
        group, started = int(pid), int(started)
    except (FileNotFoundError, ValueError):
        return
    if host != socket.gethostname():
        return
    if _stat(group)[3] not in (None, started):
        return  # a later process took the pid: the kernel frees a pid only once its group is empty
    deadline = time.monotonic() + grace_s
    while members := _group_members(group):
        if time.monotonic() > deadline:
            for member in members:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(member, signal.SIGKILL)
        time.sleep(0.2)


def record_role(pid_path: Path, role: RoleProcess) -> None:
    """Write where `role` (started in a process group of its own) runs, for `wait_for_predecessor`
    in the actor that may replace this one: this host, its pid (the group's id) and start time
    (which tells it from a later process given the same pid)."""
    pid = role.process.pid
    atomic_write_text(pid_path, f"{socket.gethostname()} {pid} {_stat(pid)[3]}\n")


def _stat(pid: int) -> tuple[str, int, int, int | None]:
    """(state, parent pid, process group, start time in clock ticks) of `pid`, from /proc; the
    start time is None for a zombie or a process that is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[-1].split()
    except OSError:
        return "", 0, 0, None
    return fields[0], int(fields[1]), int(fields[2]), None if fields[0] == "Z" else int(fields[19])


def _group_members(group: int) -> list[int]:
    """The running (not zombie) processes of process group `group`."""
    pids = [int(entry.name) for entry in Path("/proc").iterdir() if entry.name.isdigit()]
    return [pid for pid in pids if (stat := _stat(pid))[2] == group and stat[3] is not None]


class RoleActor:
    """Runs one role's process on its node (a Ray actor class once `ray.remote` wraps it). A
    server picks a free port there and announces the node's address; a vLLM server (`vllm` in
    its config: `VllmServer`) runs vLLM's python instead of `whetstone serve`, from that config."""

    def __init__(
        self, name: str, command: str, config: dict, config_path: str, log_path: str, threads: int, num_gpus: float
    ):
        role_env = config.pop("env", {})  # what the pipeline gives it (`RayRole`'s `env`)
        env, argv = gpu_environment(num_gpus), None
        if command == "serve":
            vllm = config.pop("vllm", None)
            serve = self._place_server(config)
            config = {"toml": dump_toml(serve) + "\n", "url": serve.fleet.url}
            if vllm is not None:
                argv, env = VllmServer.model_validate(vllm).command(serve, num_gpus, Path(config_path).parent, env)
        pid_path = Path(config_path).with_suffix(".pid")
        wait_for_predecessor(pid_path)
        atomic_write_text(config_path, config.pop("toml"), PRIVATE)  # its secrets as given (write_toml)
        self.url = config.get("url", "")
        self.role = RoleProcess(
            name,
            [command, config_path],
            log_path,
            threads=threads,
            env={**env, **role_env},
            command=argv,
            own_group=True,
        ).start()
        record_role(pid_path, self.role)

    @staticmethod
    def _place_server(config: dict):
        """The server's config on this node: a free port on every address, announced at the node's."""
        import ray

        from whetstone.inference.config import ServeConfig

        port, host = free_port(), ray.util.get_node_ip_address()
        fleet = {**config["fleet"], "announce": True, "url": api_root(host, port)}
        return ServeConfig.model_validate({**config, "host": "0.0.0.0", "port": port, "fleet": fleet})

    def returncode(self) -> int | None:
        return self.role.returncode

    def address(self) -> str:
        """A server's API root (empty for other roles)."""
        return self.url

    def stop(self, grace_s: float) -> int | None:
        return self.role.stop(grace_s)


class VllmServer(Config):
    """How a server actor runs vLLM (`servers.engine = "vllm"`) in place of `whetstone serve`."""

    python: str
    """vLLM's python, at this path on every node that takes a server."""
    args: list[str] = []
    """More arguments for vLLM's server (`servers.vllm_args`)."""
    pause_limit_s: float = 120.0
    """How long failed swaps may keep vLLM paused before its server stops (`servers.vllm_pause_limit_s`)."""

    def command(
        self, serve, num_gpus: float, folder: Path, ray_env: dict[str, str]
    ) -> tuple[list[str], dict[str, str]]:
        """(command line, environment) of the vLLM server of `serve` (a `ServeConfig` placed on
        this node) with the GPUs Ray gave its actor, `num_gpus` of them (`ray_env`, from
        `gpu_environment`: its CUDA_VISIBLE_DEVICES stands, and a fraction of one GPU becomes
        vLLM's own memory share, not whetstone's cap). `folder`: where the link to this node's
        whetstone (vLLM's PYTHONPATH) is made."""
        import torch

        from whetstone.integrations.vllm import vllm_launch

        device = torch.device("cuda" if num_gpus else "cpu")  # CUDA_VISIBLE_DEVICES lists Ray's GPUs
        share = num_gpus if 0 < num_gpus < 1 else None
        # per node: a restarted actor elsewhere links its own node's whetstone
        path = folder / f"vllm-path-{socket.gethostname()}"
        argv, env = vllm_launch(self.python, serve, device, share, self.args, path, self.pause_limit_s)
        return argv, {**{k: v for k, v in ray_env.items() if k != GPU_MEMORY_ENV}, **env}


class RayRole(RoleProcess):
    """A role run by a `RoleActor`, driven as a local `RoleProcess` is (running, check,
    wait_healthy, stop); its log is in the shared run folder."""

    def __init__(
        self,
        name: str,
        command: str,
        config,
        run_dir: Path,
        asks: RoleResources,
        timeout_s: float,
        vllm: VllmServer | None = None,
        role_env: dict[str, str] | None = None,
        **options,
    ):
        """`timeout_s`: to be placed and started; `vllm`: a server runs vLLM so; `role_env`: more
        environment of the role's process (sent to its actor, never written to its config file);
        `options`: further Ray actor options (custom `resources`, `max_restarts`)."""
        super().__init__(name, [], run_dir / "logs" / f"{name}.log", threads=max(1, int(asks.num_cpus)))
        self.command, self.config, self.asks, self.vllm = command, config, asks, vllm
        self.role_env = dict(role_env or {})
        self.config_path = run_dir / "roles" / f"{name}.toml"
        self.options, self.timeout_s = options, timeout_s
        self.handle = None
        self.url = ""

    def start(self) -> RayRole:
        ray = import_ray()
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.config_path.parent.mkdir(parents=True, exist_ok=True)
        if self.command == "serve":
            data = self.config.model_dump(mode="json")
            if self.vllm is not None:
                data["vllm"] = self.vllm.model_dump()
        else:
            data = {"toml": dump_toml(self.config) + "\n"}
        if self.role_env:
            data["env"] = self.role_env
        actor = ray.remote(RoleActor).options(
            name=None,
            num_cpus=self.asks.num_cpus,
            num_gpus=self.asks.num_gpus,
            **self.options,
        )
        self.handle = actor.remote(
            self.name, self.command, data, str(self.config_path), str(self.log_path), self.threads, self.asks.num_gpus
        )
        try:
            self.url = ray.get(self.handle.address.remote(), timeout=self.timeout_s)  # placed and started
        except ray.exceptions.RayActorError as err:
            raise WhetstoneError(f"{self.name} could not start on the Ray cluster: {err}") from None
        except ray.exceptions.GetTimeoutError:
            ray.kill(self.handle)
            wanted = {"CPU": self.asks.num_cpus, "GPU": self.asks.num_gpus, **self.options.get("resources", {})}
            raise WhetstoneError(
                f"{self.name} was not placed on the Ray cluster within {self.timeout_s:g} s: does a node "
                f"offer {wanted}? (placement.ray)"
            ) from None
        if self.url:
            self.health_url = self.url.removesuffix("/v1") + "/health"
        return self

    @property
    def threads(self) -> int:
        return int(self.env.get("OMP_NUM_THREADS", "1"))

    @property
    def returncode(self) -> int | None:
        ray = import_ray()
        if self.handle is None:
            return None
        try:
            return ray.get(self.handle.returncode.remote(), timeout=60)
        except ray.exceptions.RayActorError:
            return -9  # the actor (and with it the role) is gone
        except ray.exceptions.GetTimeoutError:
            return None  # a busy node: taken as still running

    @property
    def running(self) -> bool:
        return self.handle is not None and self.returncode is None

    def wait(self, timeout_s: float | None = None) -> int:
        return wait_polling(self, timeout_s)

    def stop(self, grace_s: float = 30.0) -> int | None:
        ray = import_ray()
        if self.handle is None:
            return None
        try:
            code = ray.get(self.handle.stop.remote(grace_s))
        except ray.exceptions.RayActorError:
            code = -9
        ray.kill(self.handle)
        self.handle = None
        return code

    def kill(self) -> int | None:
        ray = import_ray()
        if self.handle is not None:
            ray.kill(self.handle)
            self.handle = None
        return -9


class RayLauncher:
    """Joins the Ray cluster of `placement.ray` for one run and starts its roles there."""

    def __init__(self, config: RayConfig, run_dir: Path):
        self.config, self.run_dir = config, run_dir
        self._started_ray = False

    def connect(self) -> None:
        ray = import_ray()
        if ray.is_initialized():
            return
        address = self.config.address or os.environ.get("RAY_ADDRESS") or None
        ray.init(address=address, log_to_driver=False, configure_logging=False)
        # ray.init installs a handler that exits with code 15, and exits again on a second SIGTERM
        # in the middle of stopping the roles
        keep_sigterm_raising()
        self._started_ray = True

    def close(self) -> None:
        if self._started_ray:
            import_ray().shutdown()
            self._started_ray = False

    def midtrain(self, config, follow: Callable[[RoleProcess], None]) -> dict:
        """Mid-training of the run `config` on the cluster: its `midtrain_ranks` processes placed
        first (an error after `place_timeout_s` when no node offers them), then waited for by
        `follow` (which raises if they failed); its summary (rank 0's `summary.json`)."""
        from whetstone.run.ray_ranks import RankGroup

        self.connect()
        group = RankGroup("midtrain", "midtrain", config, self.run_dir, self.config)
        try:
            group.start()
            follow(group)
            summary = json.loads(group.read_text(0, config.midtrain.run.run_dir / "summary.json"))
        finally:
            with Stopping() as stopping:  # a signal meanwhile kills the ranks rather than leave them
                stopping.stop(group)
        if stopping.first is not None:  # mid-training had ended; the run was stopped while it stopped the ranks
            raise stopped_by(stopping.first)
        return summary

    def role(self, name: str, command: str, config, env: dict[str, str] | None = None) -> RoleProcess:
        """Role `name` (`whetstone <command>` of `config`) on the cluster, with `env` in its
        process's environment besides what its node gives it (not given to trainer ranks, which need none)."""
        if command == "trainer" and self.config.trainer_ranks > 1:
            from whetstone.run.ray_ranks import RankGroup

            return RankGroup(name, "trainer", config, self.run_dir, self.config).start()
        resources = {"trainer": self.config.trainer, "orchestrator": self.config.orchestrator}[command]
        return RayRole(
            name,
            command,
            config,
            self.run_dir,
            resources,
            self.config.place_timeout_s,
            role_env=env,
            max_restarts=self.config.role_restarts,
            max_task_retries=-1,  # a call in flight when the actor died waits for its restart
        ).start()

    def server(self, name: str, index: int, config, vllm: VllmServer | None = None) -> RayRole:
        """Server `index`, announcing its cluster label, placed on a node of that cluster;
        `whetstone serve`, or the vLLM server of `vllm`."""
        cluster = self.config.cluster_of(index)
        fleet = config.fleet.model_copy(update={"cluster": cluster, "registry": config.sync.store})
        sync = config.sync.model_copy(update={"store": self.config.cluster_stores.get(cluster, config.sync.store)})
        config = config.model_copy(update={"fleet": fleet, "sync": sync})
        placement = {} if cluster == "default" else {"resources": {f"cluster:{cluster}": 0.001}}
        return RayRole(
            name,
            "serve",
            config,
            self.run_dir,
            self.config.server,
            self.config.place_timeout_s,
            vllm,
            max_restarts=self.config.server_restarts,
            max_task_retries=-1,
            **placement,
        ).start()
