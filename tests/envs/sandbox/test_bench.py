"""The sandbox benchmark runs end to end and reports what the issue asks for (no timing asserted)."""

from whetstone.bench.sandbox import run


def test_bench_reports_latency_throughput_and_the_baseline():
    report = run(samples=3, duration_s=0.3, workers=2)
    for key in ("p50_ms", "p99_ms", "per_s", "baseline_p50_ms", "baseline_per_s", "latency_ratio", "throughput_ratio"):
        assert report[key] > 0, key
    assert report["p99_ms"] >= report["p50_ms"] and report["workers"] == 2
