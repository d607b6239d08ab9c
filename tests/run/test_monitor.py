"""The pipeline's view of running servers: their /metrics sampled into servers.jsonl (and, as
role `servers`, into TensorBoard)."""

import errno
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from tests.utils.tracking_support import as_event_value, event_scalars
from whetstone.errors import WhetstoneError
from whetstone.run.monitor import ServerSampler, last_record, parse_metrics
from whetstone.utils.metrics import read_metrics
from whetstone.utils.tracking import TensorBoardSink, TrackingConfig

PAGE = """# HELP whetstone_weight_version Version of the weights.
whetstone_weight_version{model="m"} 3
whetstone_running_sequences{model="m"} 5
whetstone_tokens_per_second{model="m"} 412.5
whetstone_swap_pause_seconds{model="m",quantile="0.5"} 0.004
whetstone_swap_pause_seconds_count{model="m"} 3
whetstone_swap_pause_seconds_last{model="m"} 0.0061
whetstone_prompt_tokens_total{model="m"} 999
"""


def test_the_sampled_gauges_are_read_from_a_prometheus_page():
    assert parse_metrics(PAGE) == {
        "weight_version": 3,
        "running_sequences": 5,
        "tokens_per_second": 412.5,
        "swap_pause_count": 3,
        "swap_pause_last_s": 0.0061,
    }


def test_a_server_that_does_not_answer_is_recorded_as_down(tmp_path):
    sampler = ServerSampler(["http://127.0.0.1:9/v1"], tmp_path / "servers.jsonl")
    with httpx.Client(timeout=1) as client:
        sampler.sample(client)
    sampler.writer.close()
    assert read_metrics(tmp_path / "servers.jsonl")[0] | {"time": 0} == {"server": 0, "up": False, "time": 0}
    assert last_record(tmp_path / "servers.jsonl")["up"] is False
    assert last_record(tmp_path / "nothing.jsonl") == {}


def test_the_last_complete_record_is_read_from_the_tail(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(f'{{"step": {i}, "pad": "{"x" * 100}"}}\n' for i in range(2000)) + '{"step": 20')
    assert last_record(path, tail_bytes=4096)["step"] == 1999  # the torn last line is skipped


class MetricsPage(BaseHTTPRequestHandler):
    """A server's /metrics page: PAGE."""

    def do_GET(self):
        body = PAGE.encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def test_each_server_s_samples_go_to_tensorboard_under_its_own_tags(tmp_path):
    with ThreadingHTTPServer(("127.0.0.1", 0), MetricsPage) as page:
        threading.Thread(target=page.serve_forever, daemon=True).start()
        roots = [f"http://127.0.0.1:{page.server_address[1]}/v1", "http://127.0.0.1:9/v1"]
        sampler = ServerSampler(roots, tmp_path / "servers.jsonl", tracking=TrackingConfig())
        with httpx.Client(timeout=1) as client:
            for _ in range(2):
                sampler.sample(client)
        sampler.writer.close()
        page.shutdown()
    samples = read_metrics(tmp_path / "servers.jsonl")
    events = event_scalars(tmp_path / "tensorboard" / "servers")
    assert set(events) == {f"server0/{key}" for key in ["up", *parse_metrics(PAGE)]} | {"server1/up"}
    for server, key in [(0, "weight_version"), (0, "swap_pause_last_s"), (0, "up"), (1, "up")]:
        mine = [s for s in samples if s["server"] == server]  # the n-th round at step n
        assert events[f"server{server}/{key}"] == [(n, as_event_value(s[key]), s["time"]) for n, s in enumerate(mine)]


def test_a_sample_that_cannot_be_written_ends_the_sampling_and_is_raised_once_logged(monkeypatch, caplog):
    """/dev/full takes no byte (ENOSPC, as a full disk): the sampling thread ends on its first
    sample, without a thread traceback; the error is logged as one line, kept, and raised by
    `check` and when the sampler's block ends."""
    uncaught = []
    monkeypatch.setattr(threading, "excepthook", uncaught.append)
    message = (
        r"^sampling the servers and CPU time failed: cannot write /dev/full: No space left on device: "
        r"free space on its disk, then run the command again$"
    )
    sampler = ServerSampler(["http://127.0.0.1:9/v1"], "/dev/full", interval_s=0.01)
    with pytest.raises(WhetstoneError, match=message):
        with sampler:
            sampler._thread.join(timeout=60)
            assert not sampler._thread.is_alive()  # ended by itself, not stopped
            with pytest.raises(WhetstoneError, match=message):
                sampler.check()
    assert uncaught == []
    logged = [r for r in caplog.records if r.name == "whetstone.run"]
    assert [(r.levelname, r.getMessage()) for r in logged] == [("ERROR", str(sampler.error))]


def test_a_tracking_sink_that_raises_stops_the_sampling_and_the_main_thread_at_once(tmp_path, monkeypatch, caplog):
    """A TensorBoard writer that raises (its event file's disk is full) ends the sampling as a
    full servers.jsonl does, as it would stop any other role: logged once with its traceback,
    no thread traceback, and raised where the main thread waits (`interrupt_main`), its sleep
    cut short; the sample's JSONL line was written before. The sink's close failing too (its
    flush) is logged, not raised in place of the first failure."""
    uncaught = []
    monkeypatch.setattr(threading, "excepthook", uncaught.append)
    failure = OSError(errno.ENOSPC, "No space left on device")

    def log(self, values, step, walltime):
        raise failure

    def close(self, failed):  # it fails again as it flushes
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(TensorBoardSink, "log", log)
    monkeypatch.setattr(TensorBoardSink, "close", close)
    sampler = ServerSampler(
        ["http://127.0.0.1:9/v1"], tmp_path / "servers.jsonl", 0.01, tracking=TrackingConfig(), interrupt_main=True
    )
    message = r"^sampling the servers and CPU time failed: OSError: \[Errno 28\] No space left on device$"
    slept = []
    with pytest.raises(WhetstoneError, match=message) as raised:
        with sampler:
            time.sleep(30)
            slept.append(True)
    assert slept == [] and not sampler._thread.is_alive() and uncaught == []
    assert raised.value is sampler.error and sampler.error.__cause__ is failure
    logged = [r for r in caplog.records if r.name == "whetstone.run"]
    assert [(r.levelname, r.getMessage(), r.exc_info and r.exc_info[1]) for r in logged] == [
        ("ERROR", str(sampler.error), failure),
        ("WARNING", f"closing {tmp_path / 'servers.jsonl'} after sampling failed: OSError: {failure}", None),
    ]
    assert [r | {"time": 0} for r in read_metrics(tmp_path / "servers.jsonl")] == [
        {"server": 0, "up": False, "time": 0}
    ]


def test_a_cpu_file_that_cannot_be_opened_closes_the_servers_file_opened_before(tmp_path, monkeypatch):
    """cpu.jsonl is opened after servers.jsonl: when it cannot be (here a folder in its place), the
    sampler is not made, and the servers' writer (its file and its tracking sinks) is closed."""
    from whetstone.utils.metrics import MetricsWriter

    opened = []
    open_writer = MetricsWriter.__init__

    def recorded(self, *args, **kwargs):
        open_writer(self, *args, **kwargs)
        opened.append(self)

    monkeypatch.setattr(MetricsWriter, "__init__", recorded)
    closed = []
    close_sink = TensorBoardSink.close
    monkeypatch.setattr(TensorBoardSink, "close", lambda sink, failed: closed.append(sink) or close_sink(sink, failed))
    (tmp_path / "cpu.jsonl").mkdir()
    with pytest.raises(WhetstoneError, match=f"^cannot write {tmp_path / 'cpu.jsonl'}: Is a directory$"):
        ServerSampler(
            ["http://127.0.0.1:9/v1"],
            tmp_path / "servers.jsonl",
            cpu_groups={"trainer": object()},
            cpu_path=tmp_path / "cpu.jsonl",
            tracking=TrackingConfig(),
        )
    [servers] = opened
    assert servers.path == tmp_path / "servers.jsonl" and servers._handle.closed and closed == servers._sinks
