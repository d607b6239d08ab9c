"""A role's torch.distributed ranks as processes of this machine (`placement.trainer_ranks` or
`placement.midtrain_ranks` > 1 with the local backend): what `torchrun --standalone
--nproc_per_node N` would start, driven by `whetstone run` as one role.

Rank i is the role's command line with torchrun's environment (`rank_environment`): MASTER_ADDR
127.0.0.1 and a free MASTER_PORT, RANK = LOCAL_RANK = i, WORLD_SIZE = LOCAL_WORLD_SIZE = N. The
ranks then meet as under torchrun (`training/distributed.py`): on GPUs rank i computes on cuda:i
over NCCL, on the CPU they are gloo ranks sharing the role's cores. Rank 0's log is the role's
(`logs/<name>.log`), rank i's `logs/<name>-rank<i>.log`.

The ranks are one FSDP job: a rank that exits with an error, or is killed, leaves the others
waiting in a collective, so the group then stops them and takes that rank's exit code. `stop`
sends SIGTERM to every rank at once (a trainer's ranks finish their step and checkpoint, rank 0
deciding for all) and SIGKILL to those still running after the grace period.
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

from whetstone.errors import WhetstoneError
from whetstone.utils.processes import RoleProcess, free_port, wait_polling

PLACED_RANK_ENV = "WHETSTONE_PLACED_RANK"
"""Set for every rank a run starts (here or on Ray, one rank too): `whetstone run --midtrain-only`
in such a process is that rank's part, not a run to place (torchrun's ranks are known by
WORLD_SIZE > 1)."""
FAILED_GRACE_S = 30.0
"""How long the other ranks of a group whose rank failed may take to end on SIGTERM before
SIGKILL (they are usually stuck in a collective that will not complete)."""


def rank_environment(
    rank: int,
    world_size: int,
    port: int,
    master: str = "127.0.0.1",
    local_rank: int | None = None,
    local_world_size: int | None = None,
) -> dict[str, str]:
    """Rank `rank`'s torchrun environment, rank 0 at `master`:`port`; by default every rank on
    this machine (LOCAL_RANK = RANK)."""
    return {
        "MASTER_ADDR": master,
        "MASTER_PORT": str(port),
        "RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_RANK": str(rank if local_rank is None else local_rank),
        "LOCAL_WORLD_SIZE": str(world_size if local_world_size is None else local_world_size),
        PLACED_RANK_ENV: "1",
    }


class RankedRole(RoleProcess):
    """A role run as the ranks of one job and driven as one role (`LocalRankGroup`, Ray's
    `RankGroup`): rank 0's log is the role's, rank i's `<name>-rank<i>.log`; `failed_rank` is the
    rank whose exit code the role's is, and `check` raises with the end of its log."""

    failed_rank = 0
    code: int | None = None
    """The role's exit code, once it has one."""

    def stopped(self, codes: list[int | None]) -> int | None:
        """The role's code once its ranks were stopped with `codes`: the code it had already, or
        the first rank's that is not 0 (naming that rank), or 0."""
        if self.code is None:
            self.failed_rank = next((rank for rank, code in enumerate(codes) if code), 0)
            self.code = codes[self.failed_rank] or 0
        return self.code

    def rank_log(self, rank: int) -> Path:
        return self.log_path if rank == 0 else self.log_path.with_name(f"{self.name}-rank{rank}.log")

    def log_tail(self, chars: int = 3000) -> str:
        try:
            return self.rank_log(self.failed_rank).read_text(errors="replace")[-chars:]
        except FileNotFoundError:
            return ""

    def check(self) -> None:
        code = self.returncode
        if code not in (None, 0):
            raise WhetstoneError(
                f"{self.name} rank {self.failed_rank} exited with code {code}; end of "
                f"{self.rank_log(self.failed_rank)}:\n{self.log_tail()}"
            )

    def wait(self, timeout_s: float | None = None) -> int:
        """The role's exit code, polled; raises if it still runs after `timeout_s`."""
        return wait_polling(self, timeout_s)


class LocalRankGroup(RankedRole):
    """`size` processes of `whetstone <args>`, the ranks of one job, driven as one role (running,
    returncode, check, wait, stop, kill). `options` are each rank's `RoleProcess` options
    (threads, env, cpus, cpu_group)."""

    def __init__(self, name: str, args: list[str], log_path: Path, size: int, **options):
        super().__init__(name, args, log_path)
        env = options.pop("env", None) or {}
        port = free_port()
        self.ranks = [
            RoleProcess(
                name if rank == 0 else f"{name}-rank{rank}",
                args,
                self.rank_log(rank),
                env={**env, **rank_environment(rank, size, port)},
                **options,
            )
            for rank in range(size)
        ]

    def start(self) -> LocalRankGroup:
        try:
            for rank in self.ranks:
                rank.start()
        except BaseException:
            self.kill()  # the ranks started so far would wait for the others for ever
            raise
        return self

    @property
    def returncode(self) -> int | None:
        """0 once every rank exited cleanly; the code of the first rank that failed (the others
        stopped); None while they run."""
        if self.code is not None or self.ranks[0].process is None:
            return self.code
        codes = [rank.returncode for rank in self.ranks]
        failed = [index for index, code in enumerate(codes) if code not in (None, 0)]
        if failed:
            self.failed_rank = failed[0]
            self.code = codes[self.failed_rank]
            self._end(FAILED_GRACE_S)
        elif all(code == 0 for code in codes):
            self.code = 0
        return self.code

    @property
    def running(self) -> bool:
        return self.ranks[0].process is not None and self.returncode is None

    def wait(self, timeout_s: float | None = None) -> int:
        """The group's exit code, polled (a failed rank ends the others)."""
        if self.ranks[0].process is None:
            raise WhetstoneError(f"{self.name} was never started")
        return super().wait(timeout_s)

    def _end(self, grace_s: float) -> list[int | None]:
        """SIGTERM to every running rank at once (once: `RoleProcess.terminate`), SIGKILL to
        those left after `grace_s`; the ranks' exit codes."""
        deadline = max((rank.terminate(grace_s) for rank in self.ranks if rank.running), default=0.0)
        for rank in self.ranks:
            if rank.process is None:
                continue
            try:
                rank.process.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                rank.kill()
        return [rank.returncode for rank in self.ranks]

    def stop(self, grace_s: float = 30.0) -> int | None:
        if self.ranks[0].process is None:
            return None
        return self.stopped(self._end(grace_s))

    def kill(self) -> int | None:
        for rank in self.ranks:
            if rank.process is not None:
                rank.kill()
        return self.returncode
