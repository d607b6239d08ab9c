"""The sandbox benchmark runs end to end and reports what the issue asks for (no timing asserted)."""

import subprocess
import sys
import textwrap

import pytest

from whetstone.bench.sandbox import run
from whetstone.errors import WhetstoneError


def test_bench_reports_latency_throughput_and_the_baseline():
    report = run(samples=3, duration_s=0.3, workers=2)
    for key in ("p50_ms", "p99_ms", "per_s", "baseline_p50_ms", "baseline_per_s", "latency_ratio", "throughput_ratio"):
        assert report[key] > 0, key
    assert report["p99_ms"] >= report["p50_ms"] and report["workers"] == 2


@pytest.mark.timeout(60)
def test_bad_settings_are_named_before_any_sandbox_starts():
    with pytest.raises(WhetstoneError, match="samples must be >= 1, got 0"):
        run(samples=0, duration_s=0.3)
    with pytest.raises(WhetstoneError, match="duration_s must be > 0 seconds, got -1"):
        run(samples=3, duration_s=-1)


def test_an_interrupted_throughput_measurement_stops_its_threads():
    """A Ctrl-C while the workers run ends the measurement with it; the pool's exit, which waits
    for its threads, must not wait for ever on threads that were never told to stop."""
    script = textwrap.dedent(
        """
        import signal, threading, time
        from whetstone.bench.sandbox import _throughput

        def interrupt(*_):
            raise KeyboardInterrupt

        signal.signal(signal.SIGALRM, interrupt)
        signal.setitimer(signal.ITIMER_REAL, 0.2)
        try:
            _throughput(lambda: time.sleep(0.01), workers=2, duration_s=10)
        except KeyboardInterrupt:
            print("interrupted", threading.active_count())
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.stdout.split() == ["interrupted", "1"], done.stderr  # only the main thread is left
