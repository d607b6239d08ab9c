"""Metrics as JSONL (utils/metrics.py): what a crash mid-write leaves, and what comes after it."""

from whetstone.utils.metrics import MetricsWriter, read_metrics


def test_a_record_after_a_torn_last_line_starts_a_line_of_its_own(tmp_path):
    path = tmp_path / "metrics.jsonl"
    with MetricsWriter(path) as writer:
        writer.write({"step": 1})
    with path.open("a") as crashed:  # a role killed while it wrote step 2
        crashed.write('{"step": 2, "lo')
    for _ in range(2):  # restarted, it writes step 2 again; then once more, after a clean end
        with MetricsWriter(path) as writer:
            writer.write({"step": 2})
    assert [record["step"] for record in read_metrics(path)] == [1, 2, 2]
    assert path.read_text().count("\n") == 4  # the torn line, ended, and one line per record
