"""`whetstone run` end to end at tiny scale: mid-training, two real `whetstone serve` processes,
the trainer and the orchestrator as processes, held-out evaluations before and after, the report.
The tiny config and its tasks: tests/run/run_support.py.
"""

import itertools
import json
import os
import re
import signal
import sys
import threading
import time
import tomllib
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace

import pytest
import torch

from tests.envs.harness.harness_support import tokenizer
from tests.run.run_support import tiny_run
from tests.utils.tracking_support import assert_tracked
from whetstone.errors import WhetstoneError
from whetstone.model.hf import load_hf
from whetstone.run import pipeline as pipeline_module
from whetstone.run.pipeline import Pipeline, run_pipeline
from whetstone.utils.cgroups import why_no_cpu_groups
from whetstone.utils.metrics import read_metrics
from whetstone.utils.processes import RoleProcess


@pytest.mark.timeout(300)
def test_the_whole_pipeline_runs_as_processes_and_reports(tmp_path, capfd, monkeypatch):
    for name in ("FORCE_COLOR", "TTY_COMPATIBLE", "TTY_INTERACTIVE"):  # stderr is a file here, as in `> log 2>&1`
        monkeypatch.delenv(name, raising=False)
    quotas = why_no_cpu_groups() is None  # then each side also runs under a CPU quota, and its CPU is counted
    token = "tiny-run-token-93ab"  # the servers take only clients sending it: the run gives it to its own
    summary = run_pipeline(
        tiny_run(
            tmp_path,
            f'servers.serve.auth_token="{token}"',
            *(["placement.trainer_cores=1.0", "placement.rollout_cores=2.0"] if quotas else []),
        )
    )
    run = tmp_path / "runs" / "tiny"
    written_summary = json.loads((run / "summary.json").read_text())
    assert written_summary["heldout_pass1_after"] == summary["heldout_pass1_after"]
    assert written_summary["config"]["servers"]["serve"]["auth_token"] == "***"
    holding = {
        p.relative_to(run).as_posix() for p in run.rglob("*") if p.is_file() and token.encode() in p.read_bytes()
    }
    assert holding == {"config.toml", "roles/serve-0.toml", "roles/serve-1.toml"}  # each 0600, below
    assert 0.0 <= summary["heldout_pass1_before"] <= 1.0 and 0.0 <= summary["heldout_pass1_after"] <= 1.0
    assert summary["wall_s"] > 0 and summary["config"]["rl"]["steps"] == 2
    steps = read_metrics(run / "trainer" / "metrics.jsonl")
    assert [s["step"] for s in steps] == [0, 1] and steps[-1]["version"] == 2  # published every step
    assert all(s["demo_nll"] > 0 for s in steps)  # the anchor read the run's demonstrations file
    assert len(read_metrics(run / "orchestrator" / "metrics.jsonl")) == 2
    status = json.loads((run / "orchestrator" / "status.json").read_text())  # its totals, as it ended
    assert status["batches_put"] == 2 and status["groups_finished"] >= status["groups_kept"] >= 2
    assert {r["server"] for r in read_metrics(run / "servers.jsonl")} == {0, 1}
    after = json.loads((run / "eval" / "after" / "report.json").read_text())
    assert after["rollouts"] == 8  # the headline temperature's; the sweep's points beside them
    check_temperature_sweep(summary, after)
    board = run / "tensorboard"  # every role's numbers, at the steps of its metrics.jsonl
    assert {p.name for p in board.iterdir()} == {"midtrain", "trainer", "orchestrator", "servers"} | (
        {"cpu"} if quotas else set()
    )
    assert_tracked(board / "midtrain", read_metrics(run / "midtrain" / "metrics.jsonl"))
    assert_tracked(board / "trainer", steps)
    assert_tracked(board / "orchestrator", read_metrics(run / "orchestrator" / "metrics.jsonl"), step_key="index")
    html = (run / "report.html").read_text()
    assert "held-out pass@1 at temperature 1:" in html and html.count("<img") >= 5
    assert "<h2>Held-out pass@1 by sampling temperature</h2>\n<img" in html
    assert "gain over the best temperature (± paired SE)</td><td>" in html
    for role in ("serve-0", "serve-1", "trainer", "orchestrator"):
        assert (run / "roles" / f"{role}.toml").stat().st_mode & 0o777 == 0o600  # its secrets as given
        assert (run / "logs" / f"{role}.log").exists()
    assert summary["final_logit_scale"] == pytest.approx(steps[-1]["logit_scale"])  # the trainer's last step's
    assert summary["model"] == str(run / "model") and load_hf(run / "model").cfg.num_experts == 4
    assert (run / "config.toml").stat().st_mode & 0o777 == 0o600
    written = tomllib.loads((run / "config.toml").read_text())  # as it ran: the servers' addresses too
    used = tomllib.loads((run / "roles" / "orchestrator.toml").read_text())
    assert written["rl"]["orchestrator"] == used and written["eval"]["servers"] == used["servers"]
    assert written["eval"]["harness"]["max_turns"] == written["rl"]["orchestrator"]["harness"]["max_turns"] == 2
    err = capfd.readouterr().err.splitlines()  # every stage's progress, as plain lines
    for stage in (
        "midtrain midtrain: 1,024/1,024 tok (100%)",
        "held-out eval (before): 16/16 rollout (100%)",  # 4 tasks x 2 samples x 2 temperatures
        "rl: 2/2 step (100%)",
        "held-out eval (after): 24/24 rollout (100%)",  # and at 1 x the learned scale
    ):
        assert any(line.startswith(stage) for line in err), stage
    assert any(
        line.startswith("trainer: 2/2 step (100%)") for line in (run / "logs" / "trainer.log").read_text().splitlines()
    )
    if quotas:
        cpu = read_metrics(run / "cpu.jsonl")
        assert set(cpu[-1]["cpu_s"]) == {"trainer", "rollout"} and cpu[-1]["cpu_s"]["rollout"] > 0
        assert "CPU used while the roles ran, trainer / rollout side (cores)</td><td>0." in html
        from whetstone.utils.cgroups import cpu_group_parents

        parents = cpu_group_parents()[1].values()
        assert not [g for parent in parents for g in parent.glob(f"whetstone-*-{os.getpid()}-*")]  # groups removed


class _Clock:
    """The pipeline's monotonic clock, moved past `rl.max_wall_time` once `ready()` holds."""

    def __init__(self, ready):
        self.ready, self.offset = ready, 0.0

    def monotonic(self) -> float:
        if not self.offset and self.ready():
            self.offset = 1e6
        return time.monotonic() + self.offset


@pytest.mark.timeout(300)
@pytest.mark.parametrize("ranks", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_rl_stops_at_its_wall_time_and_the_run_goes_on_with_that_step(tmp_path, monkeypatch, ranks):
    # the wall time is up once the trainer has logged a step: it finishes the step it is on,
    # checkpoints and publishes it, and the run evaluates and exports that step's policy (with
    # 2 local ranks, every rank gets SIGTERM and they end as one)
    metrics = tmp_path / "runs" / "tiny" / "trainer" / "metrics.jsonl"
    clock = _Clock(lambda: metrics.exists() and len(read_metrics(metrics)) >= 1)
    monkeypatch.setattr(
        pipeline_module, "time", SimpleNamespace(monotonic=clock.monotonic, sleep=time.sleep, time=time.time)
    )
    summary = run_pipeline(
        tiny_run(tmp_path, "rl.steps=1000", "rl.max_wall_time=60", f"placement.trainer_ranks={ranks}")
    )
    rl = summary["stages"]["rl"]
    steps = read_metrics(metrics)
    assert rl["stopped_at_wall_time"] and rl["steps_planned"] == 1000 and steps[-1]["world_size"] == ranks
    assert 1 <= rl["steps"] == len(steps) < 1000 and steps[-1]["version"] == rl["steps"]
    assert summary["final_logit_scale"] == pytest.approx(steps[-1]["logit_scale"])  # that step's policy
    assert summary["heldout_pass1_after"] is not None and load_hf(tmp_path / "runs" / "tiny" / "model")


@pytest.mark.timeout(300)
def test_rl_out_of_time_before_its_first_step_ends_with_the_mid_trained_policy(tmp_path, monkeypatch):
    # up at the first look after RL started (a second in: no group can have finished): the run
    # evaluates nothing more, exports the mid-trained model and says why RL made no step
    calls = itertools.count()
    clock = _Clock(lambda: next(calls) >= 1)
    monkeypatch.setattr(
        pipeline_module, "time", SimpleNamespace(monotonic=clock.monotonic, sleep=time.sleep, time=time.time)
    )
    summary = run_pipeline(tiny_run(tmp_path, "rl.steps=1000", "rl.max_wall_time=5"))
    run_dir = tmp_path / "runs" / "tiny"
    rl = summary["stages"]["rl"]
    assert rl["steps"] == 0 and rl["steps_planned"] == 1000 and rl["stopped_at_wall_time"]
    assert rl["no_step_reason"].startswith("the orchestrator put no batch in 5 s")
    assert summary["heldout_pass1_before"] is not None and summary["heldout_pass1_after"] is None
    assert summary["final_logit_scale"] is None and not (run_dir / "eval" / "after").exists()
    exported, base = load_hf(run_dir / "model"), load_hf(run_dir / "midtrain" / "model")
    assert all(torch.equal(a, b) for a, b in zip(exported.state_dict().values(), base.state_dict().values()))
    assert "RL made no step" in (run_dir / "report.html").read_text()


@pytest.mark.timeout(300)
def test_an_orchestrator_that_gives_up_ends_rl_and_the_run_goes_on(tmp_path):
    # no group can have reward variance (the spread asked for is beyond any reward): the
    # orchestrator stops after one batch's worth of groups, and the run ends RL there (no time
    # bound set), with the mid-trained policy, and says why
    summary = run_pipeline(
        tiny_run(
            tmp_path,
            "rl.steps=1000",
            "rl.orchestrator.advantages.min_reward_spread=100",
            "rl.orchestrator.max_fruitless_batches=1",
        )
    )
    run_dir = tmp_path / "runs" / "tiny"
    rl = summary["stages"]["rl"]
    assert rl["steps"] == 0 and not rl["stopped_at_wall_time"]
    assert (
        rl["orchestrator_stopped"].startswith("the last ") and "gave nothing to train on" in rl["orchestrator_stopped"]
    )
    assert rl["no_step_reason"] == f"the orchestrator stopped: {rl['orchestrator_stopped']}"
    assert summary["heldout_pass1_after"] is None and load_hf(run_dir / "model")
    status = json.loads((run_dir / "orchestrator" / "status.json").read_text())
    assert status["stopped"] == rl["orchestrator_stopped"] and status["batches_put"] == 0
    assert "the orchestrator stopped" in (run_dir / "report.html").read_text()


def test_rl_without_a_step_names_the_side_that_held_it_up(tmp_path):
    from whetstone.rl.batch_store import batch_key
    from whetstone.store import open_store

    pipeline = Pipeline(tiny_run(tmp_path, "rl.max_wall_time=30"))
    assert pipeline.why_no_rl_step({}) == "the orchestrator put no batch in 30 s: no group of rollouts finished"
    fruitless = {"groups_finished": 6, "groups_kept": 0, "rollouts_dropped": {"no_variance": 20, "small_group": 4}}
    assert pipeline.why_no_rl_step(fruitless) == (
        "the orchestrator put no batch in 30 s: 0 of the 6 groups that finished had something to train on "
        "(rollouts dropped: no_variance 20, small_group 4; no_variance: all solved or all failed)"
    )
    open_store(pipeline.config.rl.orchestrator.batch_store).put(batch_key(0), b"batch")
    assert pipeline.why_no_rl_step(fruitless) == (
        "the trainer did not finish its first step in 30 s (1 batch(es) put): raise rl.max_wall_time"
    )


def test_servers_metrics_that_cannot_be_written_stop_the_run_with_why(tmp_path):
    # servers.jsonl on a full disk (/dev/full): the run stops with the sampler's error wherever it
    # waits, for the servers' final version or before an evaluation
    pipeline = Pipeline(tiny_run(tmp_path, "rl.sync_timeout_s=5"))
    pipeline.run_dir.mkdir(parents=True)
    (pipeline.run_dir / "servers.jsonl").symlink_to("/dev/full")
    pipeline.urls = ["http://127.0.0.1:9/v1"]
    message = "^" + re.escape(
        f"sampling the servers and CPU time failed: cannot write {pipeline.run_dir / 'servers.jsonl'}: "
        "No space left on device: free space on its disk, then run the command again"
    )
    with pytest.raises(WhetstoneError, match=message):
        with pipeline.server_sampler(interval_s=0.01) as pipeline.sampler:
            pipeline.wait_for_version(1)  # the servers never get there: it would wait rl.sync_timeout_s
    with pytest.raises(WhetstoneError, match=message):
        with pipeline.server_sampler(interval_s=0.01) as pipeline.sampler:
            deadline = time.monotonic() + 60
            while pipeline.sampler.error is None and time.monotonic() < deadline:
                time.sleep(0.01)  # until its first sample has failed
            pipeline.evaluate("before")


class HeldServer(BaseHTTPRequestHandler):
    """An inference server that never answers: each request is recorded and held until the
    server's `release` is set (its `on_request` is called with the first)."""

    def do_GET(self):
        self.server.requests.append(self.path)
        if len(self.server.requests) == 1:
            self.server.on_request()
        self.server.release.wait(60)
        self.server.answered.append(self.path)

    def log_message(self, *args):
        pass


@pytest.mark.timeout(120)
def test_a_sampler_that_fails_during_an_evaluation_stops_the_run_at_once(tmp_path):
    # servers.jsonl's disk fills while the evaluation before RL waits on its server's first answer:
    # the run stops then, with the sampler's error and its roles stopped, the evaluation's request
    # still unanswered, not once the evaluation ends (its server's health times out after 5 s)
    pipeline = Pipeline(tiny_run(tmp_path))
    tokenizer().save(pipeline.model_dir)  # the evaluation's harness reads the mid-trained model's
    pipeline.urls = ["http://127.0.0.1:9/v1"]  # the sampled server is down: its samples say so
    full = os.open("/dev/full", os.O_WRONLY)

    def disk_fills():
        os.dup2(full, pipeline.sampler.writer._handle.fileno())  # servers.jsonl's next line: ENOSPC

    with ThreadingHTTPServer(("127.0.0.1", 0), HeldServer) as server:
        server.requests, server.answered, server.release, server.on_request = [], [], threading.Event(), disk_fills
        threading.Thread(target=server.serve_forever, daemon=True).start()
        pipeline.config = pipeline.config.resolved([f"http://127.0.0.1:{server.server_address[1]}/v1"])
        idle = RoleProcess(
            "idle", [], tmp_path / "idle.log", command=[sys.executable, "-c", "import time; time.sleep(60)"]
        )
        message = "^" + re.escape(
            f"sampling the servers and CPU time failed: cannot write {pipeline.run_dir / 'servers.jsonl'}: "
            "No space left on device: free space on its disk, then run the command again"
        )
        try:
            with pytest.raises(WhetstoneError, match=message):
                with pipeline.roles_stopped():
                    pipeline.roles.append(idle.start())
                    with pipeline.server_sampler(interval_s=0.01) as pipeline.sampler:
                        pipeline.evaluate("before")
            assert len(server.requests) == 1 and server.answered == []  # stopped while it waited on it
            assert idle.returncode == -signal.SIGTERM  # and its roles are stopped, as on any failure
        finally:
            os.close(full)
            server.release.set()
            server.shutdown()
    assert not (pipeline.run_dir / "eval" / "before" / "report.json").exists()


def check_temperature_sweep(summary: dict, after: dict) -> None:
    """Both evaluations ran at the harness's temperature and the sweep's, on the same tasks; the
    one after also at the headline temperature x the learned scale (the weights at the base's scale)."""
    sweep, scale = summary["temperature_sweep"], summary["final_logit_scale"]
    assert summary["headline_temperature"] == sweep["headline_temperature"] == 1.0 and sweep["temperatures"] == [
        1.0,
        0.5,
    ]
    assert [p["temperature"] for p in sweep["before"]] == [1.0, 0.5]
    assert sorted(p["temperature"] for p in sweep["after"]) == sorted([1.0, 0.5, scale])
    for point in sweep["after"]:
        assert point["effective_temperature"] == pytest.approx(point["temperature"] / scale)
    assert [p["pass1"] for p in sweep["before"] if p["temperature"] == 1.0] == [summary["heldout_pass1_before"]]
    assert [p["pass1"] for p in sweep["after"] if p["temperature"] == 1.0] == [summary["heldout_pass1_after"]]
    assert [p["temperature"] for p in after["temperatures"]] == [1.0, 0.5, scale]
    assert all(p["rollouts"] == 8 and len(p["per_task"]) == 4 for p in after["temperatures"])
    best_before, best_after = sweep["best_before"], sweep["best_after"]
    assert best_before["pass1"] == max(p["pass1"] for p in sweep["before"])
    assert best_after["pass1"] == max(p["pass1"] for p in sweep["after"] if p["temperature"] in (1.0, 0.5))
    gain = summary["gain_over_best_temperature"]  # paired over the same tasks: the difference of the means
    assert (
        gain
        == sweep["gain_over_best_temperature"]["value"]
        == pytest.approx(best_after["pass1"] - best_before["pass1"])
    )
    assert summary["gain_over_best_temperature_se"] >= 0 and sweep["gain_over_best_temperature"]["tasks"] == 4
    assert sweep["scale_frozen_temperature"] == scale and summary["gain_scale_frozen_se"] >= 0
    frozen = [p["pass1"] for p in sweep["after"] if p["temperature"] == scale]
    assert summary["gain_scale_frozen"] == pytest.approx(frozen[0] - summary["heldout_pass1_before"])


def test_a_placement_on_missing_cores_is_refused_before_mid_training(tmp_path):
    config = tiny_run(tmp_path, "placement.trainer=[4096]")
    with pytest.raises(WhetstoneError, match=r"placement.trainer: cores \[4096\] are not available here"):
        run_pipeline(config)
    assert not (tmp_path / "runs" / "tiny" / "midtrain").exists()


def fake_cpu_groups(monkeypatch, refused: tuple[str, ...] = ()) -> list:
    """`CpuGroup` replaced by a stand-in that fails for the `refused` sides; returns the groups
    made, each with `removed`."""
    made = []

    class Group:
        def __init__(self, side, cores, period_us):
            if side in refused:
                raise WhetstoneError(f"CPU group {side}: cannot set its quota")
            self.removed = False
            made.append(self)

        def remove(self):
            self.removed = True

    monkeypatch.setattr(pipeline_module, "CpuGroup", Group)
    return made


def test_cpu_groups_made_before_one_that_fails_are_removed(tmp_path, monkeypatch):
    made = fake_cpu_groups(monkeypatch, refused=("rollout",))
    pipeline = Pipeline(tiny_run(tmp_path, "placement.trainer_cores=0.5", "placement.rollout_cores=1.0"))
    with pytest.raises(WhetstoneError, match="cannot set its quota"):
        pipeline.open_cpu_groups()
    assert [group.removed for group in made] == [True] and pipeline.cpu_groups == {}


def test_the_trainers_anchor_gets_the_mid_training_demonstrations(tmp_path):
    pipeline = Pipeline(tiny_run(tmp_path, "demos.count=3", 'rl.trainer.demos_path=""', "rl.trainer.demo_coef=0.5"))
    pipeline.write_demos()
    trainer = pipeline.trainer_config()
    assert trainer.demo_coef == 0.5 and trainer.demos_path == str(tmp_path / "runs" / "tiny" / "demos.jsonl")
    transcripts = [json.loads(line)["messages"] for line in open(trainer.demos_path)]
    assert len(transcripts) == 3 and all(t[-1]["role"] == "assistant" for t in transcripts)
    own = Pipeline(tiny_run(tmp_path, "demos.count=3", "name=own"))  # tiny_run's own file is kept
    own.write_demos()
    assert own.trainer_config().demos_path == str(tmp_path / "demos.jsonl")
    assert not (tmp_path / "runs" / "own" / "demos.jsonl").exists()
    off = Pipeline(
        tiny_run(tmp_path, "demos.count=3", 'rl.trainer.demos_path=""', "rl.trainer.demo_coef=0", "name=off")
    )
    off.write_demos()
    assert off.trainer_config().demos_path == "" and not (tmp_path / "runs" / "off" / "demos.jsonl").exists()


def test_an_anchor_without_demonstrations_is_refused_with_the_fields_to_set(tmp_path):
    with pytest.raises(WhetstoneError, match=r"demos.count is 0: set demos.count or rl.trainer.demos_path"):
        tiny_run(tmp_path, 'rl.trainer.demos_path=""')


@pytest.mark.skipif(why_no_cpu_groups() is not None, reason="cgroups are not writable here")
def test_the_trainers_quota_is_enforced_in_short_periods(tmp_path):
    """A trainer idling between steps would otherwise start each step with a whole 100 ms
    period's quota unspent and run above its share (TRAINER_QUOTA_PERIOD_US)."""
    from whetstone.run.pipeline import TRAINER_QUOTA_PERIOD_US
    from whetstone.utils.cgroups import PERIOD_US

    pipeline = Pipeline(tiny_run(tmp_path, "placement.trainer_cores=0.3", "placement.rollout_cores=1.7"))
    pipeline.open_cpu_groups()
    try:
        groups = pipeline.cpu_groups
        assert (groups["trainer"].period_us, groups["rollout"].period_us) == (TRAINER_QUOTA_PERIOD_US, PERIOD_US)
        assert TRAINER_QUOTA_PERIOD_US < PERIOD_US
    finally:
        for group in pipeline.cpu_groups.values():
            group.remove()


def test_invariant_numerics_on_one_side_only_are_refused_with_both_sides_named(tmp_path):
    one_side = ('rl.trainer.numerics="invariant"', 'rl.trainer.sync.publish_dtype="float32"')
    with pytest.raises(WhetstoneError, match=r"rl.trainer has \('invariant', .*servers.serve.engine has \('fast'"):
        tiny_run(tmp_path, *one_side)
    both = tiny_run(tmp_path, *one_side, 'servers.serve.engine.numerics="invariant"')
    assert both.servers.serve.engine.numerics == both.rl.trainer.numerics == "invariant"
    with pytest.raises(WhetstoneError, match=r"servers.serve.engine has \('invariant', 'bfloat16'\)"):
        tiny_run(
            tmp_path, *one_side, 'servers.serve.engine.numerics="invariant"', 'servers.serve.engine.dtype="bfloat16"'
        )


def test_cpu_groups_are_not_left_when_the_run_fails_before_or_in_its_first_stage(tmp_path, monkeypatch):
    # config.toml cannot be written (here a folder in its place; a full disk alike): no CPU group
    # is left, and one made before a stage fails is removed with the roles
    made = fake_cpu_groups(monkeypatch)
    pipeline = Pipeline(tiny_run(tmp_path, "placement.trainer_cores=0.5", "placement.rollout_cores=1.0"))
    (pipeline.run_dir / "config.toml").mkdir(parents=True)
    with pytest.raises(WhetstoneError, match="cannot write .*config.toml"):
        pipeline.run()
    assert all(group.removed for group in made) and pipeline.cpu_groups == {}

    (pipeline.run_dir / "config.toml").rmdir()

    def midtrain_fails():
        raise WhetstoneError("mid-training failed")

    monkeypatch.setattr(pipeline, "midtrain", midtrain_fails)
    with pytest.raises(WhetstoneError, match="mid-training failed"):
        pipeline.run()
    assert len(made) == 2 and all(group.removed for group in made) and pipeline.cpu_groups == {}


def test_a_server_that_exited_is_named_while_the_run_waits_for_the_final_version(tmp_path):
    # the other server holds the version, the dead one never will: the run stops at once with its
    # log, not after rl.sync_timeout_s with versions that do not say why
    pipeline = Pipeline(tiny_run(tmp_path, "rl.sync_timeout_s=8"))
    pipeline.urls = ["http://127.0.0.1:9/v1", "http://127.0.0.1:10/v1"]
    pipeline.sampler = SimpleNamespace(
        latest={0: {"server": 0, "up": False}, 1: {"server": 1, "up": True, "weight_version": 2}}, check=lambda: None
    )
    crash = "import sys; print('CUDA out of memory'); sys.exit(1)"
    dead = RoleProcess("serve-0", [], tmp_path / "serve-0.log", command=[sys.executable, "-c", crash]).start()
    dead.wait(30)
    pipeline.roles.append(dead)
    started = time.monotonic()
    with pytest.raises(
        WhetstoneError, match=r"serve-0 exited \(code 1\) before it reached weight version 2; (?s:.*)CUDA out"
    ):
        pipeline.wait_for_version(2)
    assert time.monotonic() - started < 8


@pytest.mark.timeout(60)
def test_a_server_that_exits_during_rl_stops_the_run_with_its_log(tmp_path, monkeypatch):
    # the trainer and the orchestrator wait on (here processes that sleep): the run stops at its
    # next look with the dead server's log, not once RL's wall time or the final version's wait is up
    pipeline = Pipeline(tiny_run(tmp_path))
    pipeline.sampler = SimpleNamespace(latest={}, check=lambda: None)
    waiting = [sys.executable, "-c", "import time; time.sleep(60)"]

    def start(name, *args, **kwargs):
        role = RoleProcess(name, [], tmp_path / f"{name}.log", command=waiting).start()
        pipeline.roles.append(role)
        return role

    monkeypatch.setattr(pipeline, "start", start)
    crash = "import sys; print('CUDA out of memory'); sys.exit(1)"
    dead = RoleProcess("serve-0", [], tmp_path / "serve-0.log", command=[sys.executable, "-c", crash]).start()
    dead.wait(30)
    pipeline.roles.append(dead)
    started = time.monotonic()
    with pipeline.roles_stopped():
        with pytest.raises(WhetstoneError, match=r"serve-0 exited \(code 1\) during RL; (?s:.*)CUDA out"):
            pipeline.rl()
    assert time.monotonic() - started < 30 and not any(role.running for role in pipeline.roles)
