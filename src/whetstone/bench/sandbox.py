"""Sandbox start-to-exit latency and throughput, side by side with an unsandboxed baseline.

One sample is the whole life of a sandbox: open it over a small task's files (pool checkout),
run `python -c pass` in it, close it (stop its processes, delete the workspace). The baseline
runs the same interpreter with plain `subprocess` (its own session, output captured, like the
sandbox's processes), no namespaces, no limits, so the difference is what isolation costs.
Throughput runs `workers` threads, each opening sandboxes back to back, so that every core is busy.

On a shared machine wall-clock figures depend on what else runs (`load_avg_1m` is reported), so
where a cgroup v1 `cpuacct` hierarchy is writable the CPU time of each sample, counted for this
process and everything it starts, is reported too: that does not change with the load.

    whetstone bench sandbox --json
"""

from __future__ import annotations

import math
import os
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

from whetstone.envs.sandbox import SandboxConfig, open_sandbox
from whetstone.envs.sandbox.sandbox import _runtime
from whetstone.errors import WhetstoneError
from whetstone.utils.cgroups import own_cgroup_path

TASK_FILES = {
    "calc/__init__.py": "from calc.ops import add\n",
    "calc/ops.py": "def add(a, b):\n    return a + b\n",
    "tests/test_ops.py": "from calc import add\n\n\ndef test_add():\n    assert add(1, 2) == 3\n",
    "README.md": "# calc\n",
}
CPUACCT = Path("/sys/fs/cgroup/cpuacct")


@contextmanager
def _cpu_meter() -> Iterator[Callable[[], float] | None]:
    """A clock of CPU seconds used by this process and all it starts (None where cpuacct is not writable)."""
    own = own_cgroup_path("cpuacct")
    home = CPUACCT / (own or "/").lstrip("/")
    group = home / f"whetstone-bench-{os.getpid()}"
    try:
        group.mkdir()
        (group / "cgroup.procs").write_text(str(os.getpid()))
    except OSError:
        yield None
        return
    try:
        yield lambda: int((group / "cpuacct.usage").read_text()) / 1e9
    finally:
        (home / "cgroup.procs").write_text(str(os.getpid()))
        for _ in range(200):  # released shortly after the last process in it is reaped
            try:
                group.rmdir()
                break
            except OSError:
                time.sleep(0.005)


def _percentile(samples_ms: list[float], q: float) -> float:
    ordered = sorted(samples_ms)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def _latencies(calls: list[Callable[[], None]], samples: int, cpu: Callable[[], float] | None):
    """(wall ms of each call, mean CPU ms per call or None) per call; interleaved, so all see the same machine."""
    wall: list[list[float]] = [[] for _ in calls]
    cpu_s = [0.0 for _ in calls]
    for _ in range(samples):
        for index, once in enumerate(calls):
            cpu_start, start = cpu() if cpu else 0.0, time.perf_counter()
            once()
            wall[index].append((time.perf_counter() - start) * 1000)
            cpu_s[index] += (cpu() - cpu_start) if cpu else 0.0
    return [(times, cpu_s[i] * 1000 / samples if cpu else None) for i, times in enumerate(wall)]


def _throughput(once: Callable[[], None], workers: int, duration_s: float) -> float:
    """Calls of `once` per second, `workers` threads calling it back to back for `duration_s`.
    However the wait ends (a Ctrl-C), the threads are told to stop, so that the pool's exit,
    which waits for them, returns once their calls in flight do."""
    done, stop = [0] * workers, threading.Event()

    def loop(slot: int) -> None:
        while not stop.is_set():
            once()
            done[slot] += 1

    with ThreadPoolExecutor(workers) as pool:
        start = time.perf_counter()
        futures = [pool.submit(loop, slot) for slot in range(workers)]
        try:
            time.sleep(duration_s)
        finally:
            stop.set()
        for future in futures:
            future.result()
        elapsed = time.perf_counter() - start
    return sum(done) / elapsed


def run(samples: int = 200, duration_s: float = 10.0, workers: int | None = None) -> dict:
    """p50/p99 start-to-exit and sandboxes per second, with the baseline and the ratios.

    `samples` latencies of each kind; `duration_s` seconds of throughput measurement of each kind.
    """
    if samples < 1:
        raise WhetstoneError(f"samples must be >= 1, got {samples}")
    if not duration_s > 0:
        raise WhetstoneError(f"duration_s must be > 0 seconds, got {duration_s}")
    if math.isinf(duration_s):  # the throughput half would fail in time.sleep, after the latency half
        raise WhetstoneError(f"duration_s must be a finite number of seconds, got {duration_s}")
    config = SandboxConfig()
    cores = os.cpu_count() or 1
    workers = workers or 2 * cores  # some of each sandbox's life is waiting on the kernel
    python = str(_runtime(config).python.bin_dir / "python")

    def sandboxed() -> None:
        with open_sandbox(TASK_FILES, config) as sandbox:
            result = sandbox.run(["python", "-c", "pass"])
        if result.exit_code != 0:
            raise RuntimeError(f"sandboxed python failed: {result.stderr}")

    # Started like the sandbox's processes: own session (with scheduler autogroups, that decides
    # the share of a busy machine a process gets), output captured.
    def baseline() -> None:
        subprocess.run([python, "-c", "pass"], check=True, capture_output=True, start_new_session=True)

    def host_python() -> None:
        subprocess.run([sys.executable, "-c", "pass"], check=True, capture_output=True, start_new_session=True)

    load_before = os.getloadavg()[0]  # other work on the machine inflates every wall-clock figure
    with _cpu_meter() as cpu:
        _latencies([sandboxed, baseline], 5, None)  # warm-up: templates, spares, page cache
        (sandbox_ms, sandbox_cpu), (baseline_ms, baseline_cpu) = _latencies([sandboxed, baseline], samples, cpu)
    [(host_ms, _)] = _latencies([host_python], max(10, samples // 10), None)
    sandbox_rates, baseline_rates = [], []
    for _ in range(2):  # alternate, so that both see the same background load
        sandbox_rates.append(_throughput(sandboxed, workers, duration_s / 2))
        baseline_rates.append(_throughput(baseline, workers, duration_s / 2))
    per_s, baseline_per_s = statistics.mean(sandbox_rates), statistics.mean(baseline_rates)
    p50, base_p50 = statistics.median(sandbox_ms), statistics.median(baseline_ms)
    report = {
        "p50_ms": round(p50, 2),
        "p99_ms": round(_percentile(sandbox_ms, 0.99), 2),
        "per_s": round(per_s, 1),
        "baseline_p50_ms": round(base_p50, 2),
        "baseline_p99_ms": round(_percentile(baseline_ms, 0.99), 2),
        "baseline_per_s": round(baseline_per_s, 1),
        "overhead_p50_ms": round(p50 - base_p50, 2),
        "latency_ratio": round(p50 / base_p50, 2),
        "throughput_ratio": round(per_s / baseline_per_s, 2),
        "host_python_p50_ms": round(statistics.median(host_ms), 2),
        "samples": samples,
        "workers": workers,
        "cores": cores,
        "cgroups": _runtime(config).cgroup_root is not None,
        "load_avg_1m": [round(load_before, 2), round(os.getloadavg()[0], 2)],
        "goals": {"p50_ms": 60, "per_s": 20},
    }
    if sandbox_cpu is not None and baseline_cpu is not None:
        report |= {
            "cpu_ms": round(sandbox_cpu, 2),
            "baseline_cpu_ms": round(baseline_cpu, 2),
            "cpu_bound_per_s": round(cores * 1000 / sandbox_cpu, 1),  # if the cores did nothing else
        }
    return report


if __name__ == "__main__":  # `whetstone bench sandbox`, options included
    from whetstone.bench.cli import run_as_module

    run_as_module("sandbox")
