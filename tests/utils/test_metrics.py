"""Metrics as JSONL (utils/metrics.py): what a crash mid-write leaves, and what comes after it."""

import pytest

from whetstone.errors import WhetstoneError
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


def test_a_line_that_cannot_be_written_names_the_file_and_stops_the_role():
    """/dev/full takes no byte (ENOSPC, as a full disk): the write is a WhetstoneError naming the
    file and the cause, and closing the writer does not raise again for the line it holds."""
    message = r"^cannot write /dev/full: No space left on device: free space on its disk, then run the command again$"
    with pytest.raises(WhetstoneError, match=message):
        with MetricsWriter("/dev/full") as writer:
            writer.write({"step": 1})
    writer = MetricsWriter("/dev/full")
    with pytest.raises(WhetstoneError, match=message):
        writer.write({"step": 1})
    writer.close()
