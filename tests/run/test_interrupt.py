"""`whetstone run` stopped by SIGTERM (a scheduler's stop, `kill`): it stops its roles as on
Ctrl-C (the trainer finishes its step and checkpoints), removes its CPU groups and exits 143 with
one line saying why, leaving no process behind. A second signal while it stops them makes it
kill the rest instead of waiting for them, and still leaves nothing behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.run.run_support import tiny_settings
from whetstone.utils.cgroups import cpu_group_parents, why_no_cpu_groups
from whetstone.utils.metrics import read_metrics


def children(pid: int) -> set[int]:
    """The processes `pid` started that still run."""
    found = set()
    for task in Path(f"/proc/{pid}/task").iterdir():
        found |= {int(child) for child in (task / "children").read_text().split()}
    return found


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


@pytest.mark.parametrize("replaced", [False, True], ids=["its own handler", "after a library replaced it"])
def test_sigterm_runs_the_finally_clauses_and_exits_143(tmp_path, replaced):
    # what `whetstone run` does with SIGTERM, in a process of its own: main's handling, no
    # pipeline; a library may install its own handler meanwhile (ray.init's exits with code 15),
    # and the run puts its own back
    script = f"""
import pathlib, signal, sys, time
from whetstone.cli import main
from whetstone.utils.processes import keep_sigterm_raising, sigterm_raises
import whetstone.cli as cli

def work(**_):
    try:
        with sigterm_raises():
            if {replaced}:
                signal.signal(signal.SIGTERM, lambda number, frame: sys.exit(number))
                keep_sigterm_raising()
            pathlib.Path({str(tmp_path / "started")!r}).touch()
            time.sleep(60)
    finally:
        pathlib.Path({str(tmp_path / "cleaned")!r}).touch()

cli.app = work
main()
"""
    with subprocess.Popen([sys.executable, "-c", script], stderr=subprocess.PIPE, text=True) as process:
        deadline = time.monotonic() + 60
        while not (tmp_path / "started").exists():
            assert process.poll() is None and time.monotonic() < deadline, process.stderr.read()
            time.sleep(0.05)
        process.send_signal(signal.SIGTERM)
        _, err = process.communicate(timeout=120)  # generous: a loaded CI machine once took over 30 s
    assert process.returncode == 143 and err.strip() == "stopped by SIGTERM"
    assert (tmp_path / "cleaned").exists()


SLOW_ROLE = """
import pathlib, signal, sys
from whetstone.utils.processes import apply_role_environment

apply_role_environment()  # into its CPU group, and ended with the run
asked, ready = map(pathlib.Path, sys.argv[1:])
signal.signal(signal.SIGTERM, lambda *_: asked.touch())
ready.touch()
while True:
    signal.pause()
"""
"""A role that takes its time to stop (a trainer finishing its step): SIGTERM only marks it asked."""

HELD_ROLES = """
import pathlib, sys
from whetstone.config import load_config
from whetstone.run.config import PipelineConfig
from whetstone.run.pipeline import Pipeline
from whetstone.utils.processes import RoleProcess, sigterm_raises
import whetstone.cli as cli

folder, role_script = pathlib.Path(sys.argv[1]), sys.argv[2]

@cli.app.command("hold-roles")
def hold_roles():
    pipeline = Pipeline(load_config(PipelineConfig, None, [f'output_dir="{folder}"', 'name="held"']))
    pipeline.open_cpu_groups()
    with sigterm_raises(), pipeline.roles_stopped():  # as `whetstone run` runs `Pipeline.run`
        for index in range(3):
            marks = [str(folder / f"{mark}{index}") for mark in ("asked", "ready")]
            command = [sys.executable, "-c", role_script, *marks]
            role = RoleProcess(f"role{index}", [], folder / f"role{index}.log", command=command,
                               cpu_group=pipeline.cpu_groups.get("rollout"))
            pipeline.roles.append(role.start())
        print(*(role.process.pid for role in pipeline.roles), flush=True)
        sys.stdin.readline()  # the stages; a line: they ended

cli.main(["hold-roles"])
"""
"""`Pipeline.roles_stopped` around three slow roles, in a `whetstone` command as `whetstone run` runs it."""


def wait_for(paths: list[Path], process: subprocess.Popen, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while not all(path.exists() for path in paths):
        assert process.poll() is None and time.monotonic() < deadline, process.stderr.read()
        time.sleep(0.05)


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "first, second",
    [(signal.SIGTERM, signal.SIGTERM), (signal.SIGINT, signal.SIGTERM), (None, signal.SIGINT)],
    ids=["SIGTERM twice", "Ctrl-C then SIGTERM", "stages ended then Ctrl-C"],
)
def test_a_signal_while_the_roles_stop_kills_the_rest_and_leaves_nothing(tmp_path, first, second):
    # the newest role is stopped first and takes its time; the second signal comes meanwhile
    command = [sys.executable, "-c", HELD_ROLES, str(tmp_path), SLOW_ROLE]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    popen = dict(stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    roles: list[int] = []
    with subprocess.Popen(command, **popen) as process:
        try:
            roles += [int(pid) for pid in process.stdout.readline().split()]
            assert len(roles) == 3, process.stderr.read()
            wait_for([tmp_path / f"ready{index}" for index in range(3)], process)
            if first is None:
                process.stdin.write("\n")
                process.stdin.flush()
            else:
                process.send_signal(first)
            wait_for([tmp_path / "asked2"], process)  # the run waits for the newest role to stop
            signalled = time.monotonic()
            process.send_signal(second)
            _, err = process.communicate(timeout=20)
            stopped_s = time.monotonic() - signalled
        finally:
            for pid in roles:  # what a stop cut short left behind
                if alive(pid):
                    os.kill(pid, signal.SIGKILL)
    code = first or second
    assert process.returncode == 128 + code, err
    assert err.strip() == f"stopped by {code.name}"
    assert stopped_s < 10  # not the grace of 30 s for each role
    assert not [pid for pid in roles if alive(pid)]
    # the older roles were killed at once: no SIGTERM to wait on
    assert [(tmp_path / f"asked{index}").exists() for index in range(3)] == [False, False, True]
    if why_no_cpu_groups() is None:
        parents = cpu_group_parents()[1].values()
        assert not [g for parent in parents for g in parent.glob(f"whetstone-*-{process.pid}-*")]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_sigterm_stops_the_runs_roles_cleanly(tmp_path):
    command = [sys.executable, "-m", "whetstone.cli", "run"]
    for setting in tiny_settings(tmp_path, "rl.steps=1000"):
        command += ["--set", setting]
    run = tmp_path / "runs" / "tiny"
    metrics = run / "trainer" / "metrics.jsonl"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env) as process:
        deadline = time.monotonic() + 240
        while not (metrics.exists() and read_metrics(metrics)):  # RL has taken a step
            assert process.poll() is None, process.stderr.read()[-4000:]
            assert time.monotonic() < deadline, "RL took no step in 240 s"
            time.sleep(0.5)
        roles = children(process.pid)
        assert len(roles) >= 4  # two servers, the trainer, the orchestrator
        process.send_signal(signal.SIGTERM)
        _, err = process.communicate(timeout=120)
    assert process.returncode == 128 + signal.SIGTERM, err[-4000:]
    assert err.rstrip().endswith("stopped by SIGTERM") and "Traceback" not in err
    time.sleep(1.0)
    assert not [pid for pid in roles if alive(pid)]
    steps = read_metrics(metrics)
    checkpoints = sorted((run / "trainer" / "checkpoints").glob("step_*"))
    assert checkpoints and checkpoints[-1].name == f"step_{len(steps):08d}"  # the trainer's last step, checkpointed
    assert not (run / "summary.json").exists()
    if why_no_cpu_groups() is None:
        parents = cpu_group_parents()[1].values()
        assert not [g for parent in parents for g in parent.glob(f"whetstone-*-{process.pid}-*")]
