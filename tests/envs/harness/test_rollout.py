"""Concurrent rollouts: bounded by config, sandbox work overlapping model calls, and every
rollout accounted for even when some break."""

from __future__ import annotations

import asyncio
import importlib
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.envs.harness.harness_support import ScriptedPolicy, call, synth_task, tokenizer, turn_number
from whetstone.envs.harness import AgentHarness, Harness, HarnessConfig, RolloutConfig, run_rollouts
from whetstone.envs.sandbox import open_sandbox
from whetstone.envs.trajectory import Trajectory
from whetstone.errors import WhetstoneError

rollout_module = importlib.import_module("whetstone.envs.harness.rollout")  # the package's `rollout` is the function
HARNESS = AgentHarness(HarnessConfig(context_tokens=2048), tokenizer())


def named(name: str, **changes):
    return synth_task(id=f"t/{name}", instruction=f"Task {name}: write solve(x).", **changes)


def task_name(prompt: str) -> str:
    return prompt.split("Task ")[1].split(":")[0]


class Recording(ScriptedPolicy):
    """Logs (task, turn) of each call as it starts, and how many calls were in flight at once."""

    def __init__(self, reply):
        super().__init__(reply)
        self.log: list[tuple[str, int]] = []
        self.in_flight = self.most_in_flight = 0

    async def complete(self, prompt_ids, sampling):
        prompt = tokenizer().decode(prompt_ids)
        self.log.append((task_name(prompt), turn_number(prompt)))
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            await asyncio.sleep(0.05)  # a server takes a while to answer
            return await super().complete(prompt_ids, sampling)
        finally:
            self.in_flight -= 1


def test_concurrency_is_bounded_and_results_keep_their_order():
    policy = Recording(lambda prompt: call("list_dir", path=".") if turn_number(prompt) < 2 else call("submit"))
    tasks = [named(str(i)) for i in range(2)]
    finished = []
    trajectories = asyncio.run(
        run_rollouts(
            tasks,
            policy,
            HARNESS,
            RolloutConfig(concurrency=2),
            samples=2,
            group_prefix="step3/",
            on_done=finished.append,
        )
    )
    assert [t.task_id for t in trajectories] == ["t/0", "t/0", "t/1", "t/1"]
    assert [t.group_id for t in trajectories] == [f"step3/t/{i}" for i in (0, 0, 1, 1)]
    assert sorted(map(id, finished)) == sorted(map(id, trajectories))
    assert all(t.status == "ok" and t.turns == 3 for t in trajectories)
    assert policy.most_in_flight == 2


def test_model_calls_go_on_while_another_rollout_runs_a_command():
    def reply(prompt):
        if task_name(prompt) == "slow":
            return call("run", command="sleep 1.5") if turn_number(prompt) == 0 else call("submit")
        return call("list_dir", path=".") if turn_number(prompt) < 4 else call("submit")

    policy = Recording(reply)
    asyncio.run(run_rollouts([named("slow"), named("quick")], policy, HARNESS, RolloutConfig(concurrency=2)))
    slow_calls = [i for i, (name, _) in enumerate(policy.log) if name == "slow"]
    during_the_command = [name for name, _ in policy.log[slow_calls[0] + 1 : slow_calls[1]]]
    assert during_the_command.count("quick") >= 3


def test_broken_rollouts_are_recorded_with_their_reason_and_the_others_finish(monkeypatch):
    class Selective(Harness):
        async def run(self, task, policy, sandbox):
            if task.id == "t/raises":
                raise RuntimeError("harness bug")
            if task.id == "t/hangs":
                await asyncio.sleep(60)
            return await HARNESS.run(task, policy, sandbox)

    monkeypatch.setattr(rollout_module, "OVERRUN_GRACE_S", 0.1)
    tasks = [
        named("ok"),
        named("setup", setup=["echo no database >&2; exit 3"]),
        named("slow_setup", setup=["echo waiting; sleep 30"], test_time_limit_s=0.3),
        named("raises"),
        named("hangs", time_limit_s=0.2),
        named("fine"),
    ]
    policy = ScriptedPolicy(lambda prompt: call("submit"))
    trajectories = asyncio.run(run_rollouts(tasks, policy, Selective(), RolloutConfig(concurrency=5)))
    by_id: dict[str, Trajectory] = {t.task_id: t for t in trajectories}
    assert len(trajectories) == 6 and [t.task_id for t in trajectories] == [t.id for t in tasks]
    assert by_id["t/ok"].status == by_id["t/fine"].status == "ok"
    assert "setup command 'echo no database >&2; exit 3' failed (exit code 3): no database" in by_id["t/setup"].error
    assert (
        "setup command 'echo waiting; sleep 30' timed out after 0.3 s (test_time_limit_s): waiting"
        in by_id["t/slow_setup"].error
    )
    assert by_id["t/raises"].error == "RuntimeError: harness bug"
    assert "overran the task's time limit of 0.2 s" in by_id["t/hangs"].error
    for name in ("setup", "slow_setup", "raises", "hangs"):
        failed = by_id[f"t/{name}"]
        assert failed.status == "failed" and failed.exclude_from_gradient and failed.reward == 0.0


def test_a_setup_command_stopped_by_closing_the_sandbox_says_so():
    """A rollout stopped while its setup runs closes the sandbox; the setup's error says that,
    not that the command failed with the exit code of the kill."""
    task = named("closed", setup=["touch started; sleep 30"])
    sandbox = open_sandbox(dict(task.repo_files))
    errors: list[str] = []

    def setup():
        try:
            rollout_module._setup(sandbox, task)
        except WhetstoneError as err:
            errors.append(str(err))

    thread = threading.Thread(target=setup)
    thread.start()
    deadline = time.monotonic() + 20
    while not (sandbox.workspace / "started").exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    sandbox.close()
    thread.join(20)
    assert errors == ["setup command 'touch started; sleep 30' stopped: the sandbox was closed while it ran"]


class FakeSandbox:
    closed = False

    def close(self):
        self.closed = True


def cancelled_while_opening(monkeypatch, delivered_late: bool) -> list[FakeSandbox]:
    """Cancel a rollout while its sandbox opens in a worker thread; the sandboxes it opened.
    `delivered_late`: the thread has finished, but the loop has not yet handed its result over."""
    entered, release, returning = threading.Event(), threading.Event(), threading.Event()
    opened: list[FakeSandbox] = []

    def slow_open(snapshot, config=None):
        entered.set()
        release.wait(10)
        opened.append(FakeSandbox())
        returning.set()
        return opened[-1]

    monkeypatch.setattr(rollout_module, "open_sandbox", slow_open)

    async def main():
        policy = ScriptedPolicy(lambda prompt: call("submit"))
        running = asyncio.create_task(rollout_module.rollout(named("cancelled"), policy, HARNESS, RolloutConfig()))
        while not entered.is_set():
            await asyncio.sleep(0.01)
        if delivered_late:
            release.set()
            returning.wait(10)
            time.sleep(0.1)  # the thread returns; its result waits for this loop, which is busy here
        running.cancel()
        release.set()
        with pytest.raises(asyncio.CancelledError):
            await running

    asyncio.run(main())  # waits for the worker threads to end
    return opened


@pytest.mark.parametrize("delivered_late", [False, True])
def test_a_sandbox_opened_for_a_cancelled_rollout_is_closed(monkeypatch, delivered_late):
    opened = cancelled_while_opening(monkeypatch, delivered_late)
    assert len(opened) == 1 and opened[0].closed


def test_a_rollout_stopped_while_no_worker_is_free_still_closes_its_sandbox(monkeypatch, tmp_path):
    """A stop cancels a rollout twice (asyncio.run's shutdown cancels every task, the orchestrator
    its rollouts). Its sandbox is closed even when the second cancellation comes while the close
    waits for a worker thread (here the only one runs the setup)."""
    opened = []

    def recording_open(snapshot, config=None):
        opened.append(open_sandbox(snapshot, config))
        return opened[-1]

    monkeypatch.setattr(rollout_module, "open_sandbox", recording_open)

    async def main():
        asyncio.get_running_loop().set_default_executor(ThreadPoolExecutor(max_workers=1))
        task = named("stopped", setup=["touch started; sleep 1"])
        policy = ScriptedPolicy(lambda prompt: call("submit"))
        running = asyncio.create_task(rollout_module.rollout(task, policy, HARNESS, RolloutConfig()))
        while not (opened and (opened[0].workspace / "started").exists()):
            await asyncio.sleep(0.01)
        running.cancel()
        for _ in range(3):  # the rollout reaches its `finally` and queues the close behind the setup
            await asyncio.sleep(0)
        running.cancel()
        with pytest.raises(asyncio.CancelledError):
            await running
        assert not opened[0].workspace.exists()  # closed before the rollout ended

    asyncio.run(main())
