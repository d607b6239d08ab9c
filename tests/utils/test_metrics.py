"""Metrics as JSONL (utils/metrics.py): what a crash mid-write leaves, and what comes after it."""

import logging

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


def test_a_line_that_is_not_utf8_hides_no_other_record(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(b'{"step": 1, "note": "a\xe2\x80\xa8b"}\n{"step": 2, "x": "\xff"}\n7\n{"step": 3}\n')
    assert [record["step"] for record in read_metrics(path)] == [1, 3]


def test_a_writer_resumed_at_a_step_drops_the_records_of_that_step_and_later(tmp_path, caplog):
    """What a stopped process wrote after the checkpoint its role resumes (steps 3 and 4 here) goes
    before the resumed run writes those steps again; the records before, a record without the
    step key (wherever it is) and a torn line stay byte for byte, in their places."""
    path = tmp_path / "metrics.jsonl"
    lines = [
        b'{"step": 1, "loss": 0.5}\n',
        b'{"loss":0.25,"step":2,  "time": 7}\n',  # another writer's spacing: kept as it is
        b'{"step": 3, "loss": 0.125}\n',
        b'{"note": "once", "of": {"step": 9}}\n',
        b'{"step": 4}\n',
        b'{"step": 5, "lo',
    ]
    path.write_bytes(b"".join(lines))
    path.chmod(0o640)
    caplog.set_level(logging.WARNING, logger="whetstone")
    with MetricsWriter(path, resume_at=3) as writer:
        writer.write({"step": 3, "loss": 0.0625})
    assert path.read_bytes().startswith(lines[0] + lines[1] + lines[3] + lines[5] + b"\n")
    assert [(r.get("step"), r.get("loss")) for r in read_metrics(path)] == [
        (1, 0.5),
        (2, 0.25),
        (None, None),
        (3, 0.0625),
    ]
    assert path.stat().st_mode & 0o777 == 0o640  # the file's own mode, not the temporary file's
    assert f"{path}: dropped 2 records at step 3 or later" in caplog.text

    written, inode = path.read_bytes(), path.stat().st_ino
    with MetricsWriter(path, resume_at=4), MetricsWriter(tmp_path / "new.jsonl", resume_at=0):
        pass  # nothing at step 4 or later, and no file yet: nothing is rewritten
    assert path.read_bytes() == written and path.stat().st_ino == inode


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
