"""A role's torch.distributed ranks as Ray actors: the trainer's (`placement.ray.trainer_ranks` > 1)
and mid-training's (`placement.ray.midtrain` set, `midtrain_ranks` of them).

One placement group holds a bundle per rank (the role's resources, spread by its strategy); on
bundle i a `RankActor` starts rank i's process (`whetstone trainer <config>`, `whetstone run
<config> --midtrain-only`) with the environment torchrun would give it (`rank_environments`):
MASTER_ADDR and MASTER_PORT on rank 0's node, RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE. The
ranks then join the group as under torchrun (`training/distributed.py`: gloo on CPUs, NCCL on GPUs,
each rank on the GPU of its LOCAL_RANK among its node's ranks' GPUs).

The ranks are one FSDP job: a rank that is lost (its actor or node gone, its process killed)
cannot rejoin the others, so `RankGroup` stops every rank and starts the group again, in the same
placement group (Ray places a lost node's bundles elsewhere), up to `role_restarts` times. The
new ranks resume from the newest checkpoint: the trainer's replay the batches published after it
without publishing (`trainer/setup.py`), so no batch is lost or trained twice; mid-training's
continue its schedule. A rank that exits with an error while every rank is still in place is the
role's own failure: the run stops with its log.
"""

from __future__ import annotations

import logging
from pathlib import Path

from whetstone.config import write_toml
from whetstone.errors import WhetstoneError
from whetstone.run.local_ranks import RankedRole, rank_environment
from whetstone.run.ray_launch import PREDECESSOR_GRACE_S, RayConfig, import_ray, record_role, wait_for_predecessor
from whetstone.utils.processes import GPU_MEMORY_ENV, RoleProcess, free_port

log = logging.getLogger("whetstone.run")
LOST = -9
"""The code of a rank whose actor is gone (with its process)."""


def rank_environments(places: list[dict], num_gpus: float = 1.0) -> list[dict[str, str]]:
    """The torch.distributed environment of each rank, from where each rank's actor is
    (`RankActor.where`: node id and address, its GPU ids, a free port). A node's ranks are
    numbered in rank order (LOCAL_RANK); ranks with GPUs see all of their node's ranks' GPUs
    (CUDA_VISIBLE_DEVICES) and take the one Ray gave them, at index LOCAL_RANK; ranks without
    see none. `num_gpus` below 1 (one rank sharing a GPU) holds the rank to that share of its
    GPU's memory, as `ray_launch.gpu_environment` does a role."""
    master, port = places[0]["ip"], places[0]["port"]
    envs = []
    for rank, place in enumerate(places):
        mates = [p for p in places if p["node"] == place["node"]]
        env = rank_environment(rank, len(places), port, master, mates.index(place), len(mates))
        if place["gpus"]:
            gpus = sorted({gpu for p in mates for gpu in p["gpus"]}, key=_gpu_order)
            env.update(CUDA_VISIBLE_DEVICES=",".join(gpus), LOCAL_RANK=str(gpus.index(place["gpus"][0])))
            if num_gpus < 1:
                env[GPU_MEMORY_ENV] = f"cuda:{env['LOCAL_RANK']}={num_gpus:.6g}"
        else:  # no GPU, whatever Ray left in the environment (`ray_launch.gpu_environment`)
            env["CUDA_VISIBLE_DEVICES"] = ""
        envs.append(env)
    return envs


def _gpu_order(gpu: str) -> tuple[int, str]:
    return (int(gpu), "") if gpu.isdigit() else (0, gpu)


class RankActor:
    """One rank on its node (a Ray actor class once `ray.remote` wraps it): it says where it is,
    then starts its rank process."""

    def __init__(self):
        self.role: RoleProcess | None = None

    def where(self) -> dict:
        import ray

        return {
            "ip": ray.util.get_node_ip_address(),
            "node": ray.get_runtime_context().get_node_id(),
            "gpus": [str(gpu) for gpu in ray.get_gpu_ids()],
            "port": free_port(),
        }

    def start(self, name: str, args: list[str], log_path: str, pid_path: str, threads: int, env: dict) -> int:
        """Start the rank's process (`args`: its `whetstone` command line) once the process of
        the rank it replaces (if on this node) has ended; its pid."""
        wait_for_predecessor(Path(pid_path))
        self.role = RoleProcess(name, args, log_path, threads=threads, env=env, own_group=True).start()
        record_role(Path(pid_path), self.role)
        return self.role.process.pid

    def returncode(self) -> int | None:
        return None if self.role is None else self.role.returncode

    def read_text(self, path: str) -> str:
        """A file as this node sees it (one its rank wrote, before a shared folder shows it
        elsewhere)."""
        return Path(path).read_text()

    def stop(self, grace_s: float) -> int | None:
        return None if self.role is None else self.role.stop(grace_s)


class RankGroup(RankedRole):
    """A role as rank actors, driven as one role (running, check, stop); polling it
    (`returncode`) restarts the whole group when a rank was lost. `command` is the role:
    `trainer` (`ray.trainer`, `trainer_ranks`, `trainer_strategy`; `config` a `TrainerConfig`) or
    `midtrain` (`ray.midtrain`, `midtrain_ranks`, `midtrain_strategy`; `config` the run's
    `PipelineConfig`). Rank 0's log is the role's log (`logs/<name>.log`), rank i's
    `logs/<name>-rank<i>.log`."""

    def __init__(self, name: str, command: str, config, run_dir: Path, ray_config: RayConfig):
        asks = getattr(ray_config, command)
        super().__init__(name, [], run_dir / "logs" / f"{name}.log", threads=max(1, int(asks.num_cpus)))
        self.command, self.url, self.config = command, "", config
        self.asks, self.ray_config, self.run_dir = asks, ray_config, run_dir
        self.size: int = getattr(ray_config, f"{command}_ranks")
        self.strategy: str = getattr(ray_config, f"{command}_strategy")
        self.config_path = run_dir / "roles" / f"{name}.toml"
        self.args = (
            ["trainer", str(self.config_path)]
            if command == "trainer"
            else ["run", str(self.config_path), "--midtrain-only"]
        )
        """Each rank's `whetstone` command line."""
        self.handles: list = []
        """The rank actors, rank order."""
        self.nodes: list[str] = []
        """The Ray node id of each rank, as last placed."""
        self.pids: list[int] = []
        """Each rank's process id on its node, as last started."""
        self.restarts = 0
        """Times the group was started again after a lost rank."""
        self.group = None

    def start(self) -> RankGroup:
        ray = import_ray()
        from ray.util import placement_group

        self.config_path.parent.mkdir(parents=True, exist_ok=True)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        write_toml(self.config_path, self.config)
        bundle = self.asks.bundle()
        self.group = placement_group([bundle] * self.size, strategy=self.strategy)
        try:
            ray.get(self.group.ready(), timeout=self.ray_config.place_timeout_s)
        except ray.exceptions.GetTimeoutError:
            self._remove_group()
            keys = f"placement.ray.{self.command}, {self.command}_ranks, {self.command}_strategy"
            raise WhetstoneError(
                f"{self.name} was not placed on the Ray cluster within {self.ray_config.place_timeout_s:g} s: "
                f"do its nodes offer {self.size} x {bundle} ({self.strategy})? ({keys})"
            ) from None
        try:
            self._start_ranks()
        except WhetstoneError:
            self._remove_group()
            raise
        return self

    def _start_ranks(self) -> None:
        ray = import_ray()
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        asks, timeout = self.asks, self.ray_config.place_timeout_s
        self.handles = [
            ray.remote(RankActor)
            .options(
                num_cpus=asks.num_cpus,
                num_gpus=asks.num_gpus,
                max_restarts=0,  # the group restarts as a whole (`returncode`)
                scheduling_strategy=PlacementGroupSchedulingStrategy(self.group, placement_group_bundle_index=rank),
            )
            .remote()
            for rank in range(self.size)
        ]
        try:
            places = ray.get([handle.where.remote() for handle in self.handles], timeout=timeout)
            self.nodes = [place["node"] for place in places]
            self.pids = ray.get(
                [
                    handle.start.remote(
                        f"{self.name}-rank{rank}",
                        self.args,
                        str(self.rank_log(rank)),
                        str(self.config_path.with_name(f"{self.name}-rank{rank}.pid")),
                        self.threads,
                        env,
                    )
                    for rank, (handle, env) in enumerate(zip(self.handles, rank_environments(places, asks.num_gpus)))
                ],
                timeout=timeout + PREDECESSOR_GRACE_S,
            )
        except ray.exceptions.RayError as err:  # an actor lost or late, or its start failed on its node
            self._end_ranks(0.0)
            cause = getattr(err, "cause", None) or err
            raise WhetstoneError(f"{self.name}'s ranks could not start on the Ray cluster: {cause}") from None
        log.info("%s: %d ranks on nodes %s", self.name, self.size, self.nodes)

    @property
    def threads(self) -> int:
        return int(self.env.get("OMP_NUM_THREADS", "1"))

    def _codes(self) -> list[int | None]:
        """Each rank's exit code: None while it runs (or its node is too busy to say), `LOST`
        when its actor is gone."""
        ray = import_ray()
        calls = [handle.returncode.remote() for handle in self.handles]
        codes: list[int | None] = []
        for call in calls:
            try:
                codes.append(ray.get(call, timeout=60))
            except ray.exceptions.RayActorError:
                codes.append(LOST)
            except ray.exceptions.GetTimeoutError:
                codes.append(None)
        return codes

    @property
    def returncode(self) -> int | None:
        """The group's exit code: 0 once every rank exited cleanly, a rank's error code once one
        failed with every rank in place (the others are stopped), None while it runs. A lost rank
        (actor gone, process killed by a signal) restarts the group instead, while restarts are
        left."""
        if self.code is not None or not self.handles:
            return self.code
        codes = self._codes()
        lost = [rank for rank, code in enumerate(codes) if code is not None and code < 0]
        failed = [rank for rank, code in enumerate(codes) if code is not None and code > 0]
        if lost and self.restarts < self.ray_config.role_restarts:
            self.restarts += 1
            log.warning(
                "%s: rank(s) %s lost (exit codes %s): restarting all %d ranks from the checkpoint (restart %d of %d)",
                self.name,
                lost,
                codes,
                self.size,
                self.restarts,
                self.ray_config.role_restarts,
            )
            self._end_ranks(PREDECESSOR_GRACE_S)
            self._start_ranks()
            return None
        if lost or failed:
            self.failed_rank = (lost or failed)[0]
            self.code = codes[self.failed_rank]
            self._end_ranks(PREDECESSOR_GRACE_S)
        elif all(code == 0 for code in codes):
            self.code = 0
        return self.code

    @property
    def running(self) -> bool:
        return bool(self.handles) and self.returncode is None

    def read_text(self, rank: int, path: Path) -> str:
        """File `path` as rank `rank`'s node sees it (e.g. rank 0's summary, read on the node that
        wrote it); while the ranks' actors are still there, before `stop`."""
        ray = import_ray()
        try:
            return ray.get(self.handles[rank].read_text.remote(str(path)), timeout=60)
        except ray.exceptions.RayError as err:
            cause = getattr(err, "cause", None) or err
            raise WhetstoneError(f"{self.name}: rank {rank} could not read {path}: {cause}") from None

    def _end_ranks(self, grace_s: float) -> list[int | None]:
        """Stop every rank's process (SIGTERM: the trainer's ranks checkpoint and exit; SIGKILL
        after `grace_s`, e.g. one stuck in a collective with a lost rank) and end their actors;
        the ranks' exit codes."""
        ray = import_ray()
        calls = [handle.stop.remote(grace_s) for handle in self.handles]
        codes: list[int | None] = []
        for call in calls:
            try:
                codes.append(ray.get(call))
            except ray.exceptions.RayError:
                codes.append(LOST)  # gone already, its process with it
        for handle in self.handles:
            ray.kill(handle, no_restart=True)
        self.handles = []
        return codes

    def _remove_group(self) -> None:
        if self.group is not None:
            from ray.util import remove_placement_group

            remove_placement_group(self.group)
            self.group = None

    def stop(self, grace_s: float = 30.0) -> int | None:
        if self.handles:
            self.stopped(self._end_ranks(grace_s))
        self._remove_group()
        return self.code

    def kill(self) -> int | None:
        self._end_ranks(0.0)
        self._remove_group()
        return LOST
