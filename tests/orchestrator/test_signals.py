"""SIGTERM to `whetstone orchestrator` (how `whetstone run` stops it) while rollouts run in
bubblewrap sandboxes: it stops as on Ctrl-C, with exit code 143, within seconds, and leaves no
sandbox process, sandbox folder or sandbox cgroup behind, with or without sandbox cgroups."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.orchestrator.orchestrator_support import Trainer, coin_tasks, model_folder, thread_servers
from whetstone.envs.sandbox.cgroups import find_cgroup_root
from whetstone.envs.tasks.io import write_tasks

SETUP = "sleep 300 & sleep 300"
"""Each rollout's setup command: sandboxes that are still running when SIGTERM comes."""
STOP_S = 5.0
"""How soon after SIGTERM the orchestrator must be gone: well before the setup's time limit (20 s)."""


def processes() -> dict[int, tuple[int, str, str]]:
    """Every process: pid -> (parent, state, start time), zombies included."""
    found = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            found[int(entry.name)] = (int(fields[1]), fields[0], fields[19])
    return found


def descendants(pid: int) -> dict[int, str]:
    """The processes `pid` started, and theirs: pid -> start time."""
    table = processes()
    found, todo = {}, [pid]
    while todo:
        parent = todo.pop()
        for child, (ppid, _, started) in table.items():
            if ppid == parent and child not in found:
                found[child] = started
                todo.append(child)
    return found


def still_running(started: dict[int, str]) -> list[int]:
    """Those of `started` (pid -> start time) that still run: not ended, nor an unreaped zombie."""
    table = processes()
    return [pid for pid, when in started.items() if pid in table and table[pid][2] == when and table[pid][1] != "Z"]


def command_line(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


@pytest.mark.parametrize("cgroups", [True, False], ids=["cgroups", "no-cgroups"])
def test_sigterm_stops_the_orchestrator_and_leaves_no_sandbox_behind(tmp_path, cgroups):
    model_dir = model_folder(tmp_path)
    Trainer(model_dir, tmp_path / "weights").publish()
    # closing a sandbox kills its commands at once: a stop that waited for their limit fails STOP_S
    tasks = [task.model_copy(update={"setup": [SETUP], "test_time_limit_s": 20.0}) for task in coin_tasks(1)]
    write_tasks(tasks, tmp_path / "tasks.jsonl")
    sandboxes = tmp_path / "sandboxes"
    with thread_servers(model_dir, tmp_path / "weights") as servers:
        config = tmp_path / "orchestrator.toml"
        config.write_text(f"""
servers = {json.dumps([s.url for s in servers])}
group_size = 2
groups_per_batch = 1
max_batches = 1
validate_tasks = false
batch_store = "{tmp_path / "batches"}"
weight_store = "{tmp_path / "weights"}"
poll_interval_s = 0.1
[tasks]
source = "{tmp_path / "tasks.jsonl"}"
[rollout]
concurrency = 2
[rollout.sandbox]
root_dir = "{sandboxes}"
cgroups = {json.dumps(cgroups)}
[harness]
tokenizer_path = "{model_dir}"
max_turns = 2
max_turn_tokens = 12
""")
        output = tmp_path / "orchestrator.log"
        with output.open("wb") as sink:
            process = subprocess.Popen(
                [sys.executable, "-m", "whetstone.cli", "orchestrator", str(config)],
                stdout=sink,
                stderr=subprocess.STDOUT,
                env={**os.environ, "OMP_NUM_THREADS": "1"},
            )
        try:
            deadline = time.monotonic() + 120
            while True:  # until both rollouts' sandboxes run their setup (a sleep each, one in the background)
                started = descendants(process.pid)
                if sum(command_line(pid).startswith("sleep") for pid in started) >= 4:
                    break
                assert process.poll() is None, output.read_text()[-3000:]
                assert time.monotonic() < deadline, "no sandbox ran within 120 s"
                time.sleep(0.1)
            assert any("bwrap" in command_line(pid) for pid in started)
            process.send_signal(signal.SIGTERM)
            signalled = time.monotonic()
            code = process.wait(60)
            stopped_after = time.monotonic() - signalled
        finally:
            if process.poll() is None:
                process.kill()
                process.wait()
    assert still_running(started) == []
    assert list(sandboxes.iterdir()) == []  # workspaces, templates, the sandbox Python: all removed
    groups = find_cgroup_root()
    if groups is not None:
        assert [p for d in (groups.pids_dir, groups.memory_dir) for p in d.glob(f"{process.pid}-*")] == []
    said = output.read_text()
    assert code == 128 + signal.SIGTERM, said[-3000:]
    assert said.rstrip().endswith("stopped by SIGTERM") and "Traceback" not in said
    assert stopped_after < STOP_S, f"the orchestrator took {stopped_after:.1f} s to stop"
