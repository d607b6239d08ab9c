"""Every metrics record's numbers also go to TensorBoard event files and, when asked for, to an
offline W&B run, at the step and wall time of metrics.jsonl; the JSONL stays the record."""

from __future__ import annotations

import re
import sys
import time

import pytest

from tests.utils.tracking_support import (
    as_event_value,
    event_scalars,
    use_offline_wandb,
    wandb_history,
    wandb_records,
)
from whetstone.config import load_config
from whetstone.errors import ConfigError, WhetstoneError
from whetstone.trainer.config import TrainerConfig
from whetstone.utils.metrics import MetricsWriter, read_metrics
from whetstone.utils.tracking import TrackingConfig

RECORDS = [
    {
        "step": step,
        "loss": 1.0 / (step + 1),
        "version": step + 1,
        "replayed": step == 0,
        "delta_kind": "full" if step == 0 else "delta",  # text: not a scalar
        "staleness_histogram": {"0": 6 - step, "1": step},
        "rows": [1, 2],  # a list: not a scalar
        "demo_nll": None,
    }
    for step in range(3)
]
SCALAR_TAGS = {
    "loss": lambda r: r["loss"],
    "version": lambda r: r["version"],
    "replayed": lambda r: float(r["replayed"]),
    "staleness_histogram/0": lambda r: r["staleness_histogram"]["0"],
    "staleness_histogram/1": lambda r: r["staleness_histogram"]["1"],
}


def write_all(path, tracking, records=RECORDS, **kwargs) -> list[dict]:
    with MetricsWriter(path, tracking, role="trainer", **kwargs) as metrics:
        for record in records:
            metrics.write(record)
    return read_metrics(path)


def test_event_files_hold_every_number_of_the_jsonl_at_its_step_and_time(tmp_path):
    written = write_all(tmp_path / "trainer" / "metrics.jsonl", TrackingConfig())
    events = event_scalars(tmp_path / "trainer" / "tensorboard" / "trainer")
    assert set(events) == set(SCALAR_TAGS)  # text, lists, nulls, the step and the time are not plotted
    for tag, value_of in SCALAR_TAGS.items():
        assert events[tag] == [(r["step"], as_event_value(value_of(r)), r["time"]) for r in written], tag


def test_tracking_dir_and_switch(tmp_path):
    write_all(tmp_path / "a" / "metrics.jsonl", TrackingConfig(dir=str(tmp_path / "run")))
    assert set(event_scalars(tmp_path / "run" / "tensorboard" / "trainer")) == set(SCALAR_TAGS)
    assert not (tmp_path / "a" / "tensorboard").exists()

    written = write_all(tmp_path / "off" / "metrics.jsonl", TrackingConfig(tensorboard=False))
    assert [p.name for p in (tmp_path / "off").iterdir()] == ["metrics.jsonl"] and len(written) == len(RECORDS)


def test_series_in_one_file_get_their_own_tags_and_steps(tmp_path):
    samples = [{"server": s, "up": True, "weight_version": v} for v in range(2) for s in range(2)]
    written = write_all(tmp_path / "servers.jsonl", TrackingConfig(), samples, series_key="server")
    events = event_scalars(tmp_path / "tensorboard" / "trainer")
    assert set(events) == {"server0/up", "server0/weight_version", "server1/up", "server1/weight_version"}
    for server in range(2):  # each server's n-th sample is at step n
        mine = [r for r in written if r["server"] == server]
        assert events[f"server{server}/weight_version"] == [
            (n, float(r["weight_version"]), r["time"]) for n, r in enumerate(mine)
        ]


def test_a_role_that_fails_keeps_its_jsonl_and_its_events(tmp_path):
    path = tmp_path / "metrics.jsonl"
    with pytest.raises(RuntimeError), MetricsWriter(path, TrackingConfig(), role="trainer") as metrics:
        metrics.write(RECORDS[0])
        raise RuntimeError("the step failed")
    assert read_metrics(path)[0]["loss"] == RECORDS[0]["loss"]
    assert event_scalars(tmp_path / "tensorboard" / "trainer")["loss"][0][1] == as_event_value(RECORDS[0]["loss"])


def test_an_offline_wandb_run_gets_the_same_scalars(tmp_path, monkeypatch):
    use_offline_wandb(monkeypatch, tmp_path)
    tracking = TrackingConfig(wandb=True, wandb_mode="offline", wandb_group="run1", tensorboard=False)
    config = TrainerConfig(tracking=tracking)
    written = write_all(tmp_path / "trainer" / "metrics.jsonl", tracking, run_config=config)

    history = wandb_history(tmp_path / "trainer")
    assert history == {r["step"]: {tag: value_of(r) for tag, value_of in SCALAR_TAGS.items()} for r in written}
    (run,) = [r["run"] for r in wandb_records(tmp_path / "trainer") if r.get("type") == "run"]
    assert (run["display_name"], run["run_group"]) == ("run1/trainer", "run1")
    assert not (tmp_path / "trainer" / "tensorboard").exists()


def test_a_wandb_run_that_fails_to_log_stops_the_role_at_its_next_record(tmp_path, monkeypatch):
    # W&B logs from a thread of its own: what it raises there is raised in the role, as the
    # TensorBoard sink's own failures are, not lost with the thread.
    use_offline_wandb(monkeypatch, tmp_path)
    tracking = TrackingConfig(wandb=True, wandb_mode="offline", tensorboard=False)
    path = tmp_path / "trainer" / "metrics.jsonl"
    with pytest.raises(WhetstoneError) as failed, MetricsWriter(path, tracking, role="trainer") as metrics:
        (sink,) = metrics._sinks

        def full(*args, **kwargs):
            raise OSError(28, "No space left on device")

        monkeypatch.setattr(sink._run, "log", full)
        metrics.write(RECORDS[0])
        sink._thread.join(60)  # it ended with the failure
        metrics.write(RECORDS[1])
    assert str(failed.value) == "logging trainer's metrics to W&B failed: OSError: [Errno 28] No space left on device"
    assert read_metrics(path)[0]["loss"] == RECORDS[0]["loss"]


def test_asking_for_wandb_without_it_names_the_extra_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # as if not installed
    with pytest.raises(ConfigError, match=r"tracking\.wandb.*pip install 'whetstone\[wandb\]'"):
        load_config(TrainerConfig, None, ["tracking.wandb=true"])
    assert not load_config(TrainerConfig, None, []).tracking.wandb  # off by default: no need for it


def test_without_tensorboard_installed_the_jsonl_is_written_and_a_warning_says_why(tmp_path, monkeypatch, caplog):
    for name in [name for name in sys.modules if name.startswith(("tensorboard", "torch.utils.tensorboard"))]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # as on a machine running whetstone from source
    written = write_all(tmp_path / "trainer" / "metrics.jsonl", TrackingConfig())
    assert len(written) == len(RECORDS)
    assert not (tmp_path / "trainer" / "tensorboard").exists()
    assert "tensorboard is not installed" in caplog.text


def test_a_wandb_run_that_cannot_start_is_an_error_that_says_what_to_do(tmp_path, monkeypatch):
    """Online without an API key (no `wandb login`), W&B refuses at once: the role stops before
    any work with what to do, not with W&B's traceback."""
    use_offline_wandb(monkeypatch, tmp_path)
    monkeypatch.delenv("WANDB_MODE")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # no ~/.netrc holding a key
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    tracking = TrackingConfig(wandb=True, wandb_mode="online")
    with pytest.raises(WhetstoneError) as failed:
        MetricsWriter(tmp_path / "trainer" / "metrics.jsonl", tracking, role="trainer")
    message = str(failed.value)
    assert message.startswith("tracking.wandb: W&B could not start trainer's run (UsageError: No API key"), message
    assert "wandb login" in message and 'tracking.wandb_mode = "offline"' in message


def test_a_tracking_folder_that_cannot_be_made_is_named(tmp_path):
    taken = tmp_path / "taken"
    taken.write_text("a file where the folder would go\n")
    for tracking in (TrackingConfig(dir=str(taken)), TrackingConfig(dir=str(taken), tensorboard=False, wandb=True)):
        with pytest.raises(WhetstoneError, match=f"^cannot write {re.escape(str(taken))}"):
            MetricsWriter(tmp_path / "trainer" / "metrics.jsonl", tracking, role="trainer")


def test_an_event_file_that_cannot_be_written_stops_the_role_with_the_folder_named(tmp_path, monkeypatch):
    """The event file written by TensorBoard's own thread on a full disk (here the file made a link
    to /dev/full, which takes no byte): the next record raises an error naming the folder and
    what to do, as a metrics line that cannot be written does, not the thread's OSError."""
    import threading

    from whetstone.utils import tracking

    monkeypatch.setattr(tracking, "TENSORBOARD_FLUSH_S", 0)  # every record flushed at once
    monkeypatch.setattr(threading, "excepthook", lambda args: None)  # TensorBoard's thread ends on it
    metrics = MetricsWriter(tmp_path / "metrics.jsonl", TrackingConfig(), role="trainer")
    folder = tmp_path / "tensorboard" / "trainer"
    [events] = folder.iterdir()
    events.unlink()
    events.symlink_to("/dev/full")
    message = f"^cannot write {re.escape(str(folder))}: No space left on device: free space on its disk"
    with pytest.raises(WhetstoneError, match=message):
        for step in range(500):  # raised once the thread has tried to write a record
            metrics.write({"step": step, "loss": 1.0})
            time.sleep(0.01)
    metrics.close(failed=True)
    assert len(read_metrics(tmp_path / "metrics.jsonl")) >= 2  # the JSONL has every record


class Sink:
    """A tracking sink whose close fails (a flush on a full disk) or not."""

    def __init__(self, fails: bool):
        self.fails, self.closed = fails, None

    def log(self, values, step, walltime):
        pass

    def close(self, failed):
        self.closed = failed
        if self.fails:
            raise WhetstoneError("cannot write tensorboard/trainer: No space left on device")


def test_every_sink_is_closed_whatever_another_s_close_raises(tmp_path):
    metrics = MetricsWriter(tmp_path / "metrics.jsonl")
    metrics._sinks = sinks = [Sink(fails=True), Sink(fails=False)]  # a TensorBoard sink, then a W&B run
    with pytest.raises(WhetstoneError, match="No space left on device"):
        metrics.close()
    assert [sink.closed for sink in sinks] == [False, False]
