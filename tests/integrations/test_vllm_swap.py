"""Weight swaps on a vLLM server without vLLM: the worker extension's `ServedWeights` over a fake
worker whose `reload_weights` can fail part-way, and the launcher's swap driver over a fake
HTTP server (the real ones: test_vllm.py)."""

from __future__ import annotations

import asyncio
import inspect
import json
import signal
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
import torch

import whetstone.model.hf as hf
from whetstone.inference.swap import WeightFollower, WeightUpdateError, WeightWriteError
from whetstone.integrations.vllm import vllm_health
from whetstone.integrations.vllm_serve import SwapDriver, WeightGauges, parse, served_model_name
from whetstone.integrations.vllm_worker import ServedWeights, WeightStoreFollower
from whetstone.sync import Publisher, Subscriber, SyncConfig, WeightStore
from whetstone.sync.update import TensorUpdate, WeightUpdate

NAMES = ("a", "b", "c")


class FakeWorker:
    """vLLM's worker as the extension sees it: `reload_weights` loads tensor by tensor; the next
    `failures` reloads raise after `fail_after` tensors (out of memory half-way, say)."""

    def __init__(self):
        self.params: dict[str, torch.Tensor] = {}
        self.fail_after = 1
        self.failures = 0

    def reload_weights(self, weights_iterator, is_checkpoint_format):
        for number, (name, tensor) in enumerate(weights_iterator):
            if self.failures and number == self.fail_after:
                self.failures -= 1
                raise RuntimeError("out of memory (simulated) during the reload")
            self.params[name] = tensor


@pytest.fixture
def served(monkeypatch):
    monkeypatch.setattr(hf, "read_hf_config", lambda model: None)
    monkeypatch.setattr(hf, "hf_pieces", lambda name, tensor, cfg: [(name, tensor)])
    monkeypatch.setattr(ServedWeights, "_process_raw_experts", lambda self: None)
    worker = FakeWorker()
    worker.vllm_config = SimpleNamespace(model_config=SimpleNamespace(model="unused"))
    return ServedWeights(worker, {name: (2,) for name in NAMES}, version=0)


def whole(version: int, value: float) -> WeightUpdate:
    return WeightUpdate(version, None, {n: TensorUpdate(torch.full((2,), value), None, (2,)) for n in NAMES})


def held(served: ServedWeights) -> dict[str, list[float]]:
    return {name: tensor.tolist() for name, tensor in sorted(served.worker.params.items())}


def following(served: ServedWeights) -> WeightStoreFollower:
    """The extension with a follower whose subscriber sees nothing wrong."""
    subscriber = SimpleNamespace(rejected={}, latest=served.staged_version, rejections=0, blocked=lambda: None)
    extension = WeightStoreFollower()
    extension._whetstone = WeightFollower(subscriber, served)
    return extension


def health_of(status: dict) -> dict:
    """What the server pool reads from a vLLM server whose worker answers `status`."""

    def answer(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/health":
            return httpx.Response(200)
        return httpx.Response(200, json={"results": [status]})

    async def ask():
        async with httpx.AsyncClient(transport=httpx.MockTransport(answer)) as client:
            return await vllm_health(client, "http://vllm:8000/v1")

    return asyncio.run(ask())


def test_a_write_that_fails_part_way_is_undone_and_the_last_good_version_served(served):
    served.update_weights(whole(1, 1.0))
    assert served.load() and served.version == 1 and held(served) == {n: [1.0, 1.0] for n in NAMES}

    served.update_weights(whole(2, 2.0))
    served.worker.failures = 1  # the write of version 2 fails after "a"; writing version 1 back works
    assert not served.load()
    assert held(served) == {n: [1.0, 1.0] for n in NAMES}  # version 1 whole again, not a mix
    assert served.version == 1 and served.whole and served.staged_version == 2  # kept, to be written again
    status = following(served).whetstone_status()
    assert "writing weight version 2 failed (RuntimeError: out of memory" in status["weights_problem"]
    assert "serving version 1 until it is written" in status["weights_problem"]
    health = health_of(status)
    assert health["status"] == "weights stale" and health["weight_version"] == 1

    # a delta published meanwhile merges into the staged version; the retry writes both whole
    served.update_weights(WeightUpdate(3, 2, {"c": TensorUpdate(torch.tensor([3.0]), torch.tensor([1]), (2,))}))
    assert served.load() and served.version == 3 and served.staged_version is None and served.problem is None
    assert held(served) == {"a": [2.0, 2.0], "b": [2.0, 2.0], "c": [2.0, 3.0]}
    assert following(served).whetstone_status()["weights_problem"] is None


def test_a_delta_whose_write_fails_leaves_the_host_weights_as_served(served):
    served.update_weights(whole(1, 1.0))
    served.load()
    served.update_weights(
        WeightUpdate(2, 1, {n: TensorUpdate(torch.tensor([5.0]), torch.tensor([0]), (2,)) for n in NAMES})
    )
    served.worker.failures = 1
    assert not served.load() and served.version == 1
    assert {n: t.tolist() for n, t in served.weights.items()} == {n: [1.0, 1.0] for n in NAMES}
    assert held(served) == {n: [1.0, 1.0] for n in NAMES}
    assert served.load() and held(served) == {n: [5.0, 1.0] for n in NAMES}


def test_a_model_left_holding_no_whole_version_says_so_until_a_write_succeeds(served):
    """The error is swap's `WeightWriteError`, whichever engine serves: one `except` takes both."""
    served.update_weights(whole(1, 1.0))
    served.load()
    served.update_weights(whole(2, 2.0))
    served.worker.failures = 2  # the write of version 2 fails, and so does writing version 1 back
    with pytest.raises(WeightWriteError, match="writing version 1 back failed too"):
        served.load()
    assert not served.whole and served.version == 1 and served.staged_version == 2
    assert "holds parts of versions 1 and 2" in health_of(following(served).whetstone_status())["weights_problem"]
    assert served.load() and served.whole and served.version == 2 and held(served) == {n: [2.0, 2.0] for n in NAMES}


def test_a_first_version_that_fails_cannot_be_undone(served):
    # the weights loaded from the model folder were never held by the extension: nothing to write back
    served.update_weights(whole(1, 1.0))
    served.worker.failures = 1
    with pytest.raises(WeightWriteError, match="not held here"):
        served.load()
    assert not served.whole and served.staged_version == 1


def test_a_first_version_that_is_not_whole_is_refused_before_it_is_staged(served):
    # no write of it could succeed (the folder's weights are not held here): refused, so the
    # follower records it as rejected and vLLM is never paused for it
    partial = WeightUpdate(1, None, {"a": TensorUpdate(torch.ones(2), None, (2,))})
    with pytest.raises(
        WeightUpdateError, match=r"weight version 1 leaves tensors the served model needs unknown: \['b', 'c'\]"
    ):
        served.update_weights(partial)
    assert served.staged_version is None and served.load() and served.version == 0
    served.update_weights(whole(1, 1.0))  # a whole one is taken, and a delta on it after
    served.update_weights(WeightUpdate(2, 1, {"a": TensorUpdate(torch.tensor([5.0]), torch.tensor([0]), (2,))}))
    assert served.load() and held(served)["a"] == [5.0, 1.0]


def test_a_swap_keeps_one_copy_of_the_weights_on_the_host(served):
    # the update is applied to the served weights in place, and vLLM is handed a copy of one
    # tensor at a time (a swap of a model of S bytes needs S more, not 2 S)
    served.update_weights(whole(1, 1.0))
    served.load()
    update = whole(2, 2.0)
    storage = {name: change.values.data_ptr() for name, change in update.tensors.items()}  # the update's own
    reload = served.worker.reload_weights

    def reload_counting_copies(weights_iterator, is_checkpoint_format):
        assert inspect.isgenerator(weights_iterator)  # copies made as they are taken, not all first
        for name, tensor in weights_iterator:
            assert {n: t.data_ptr() for n, t in served.weights.items()} == storage  # no copy of the update
            assert tensor.data_ptr() != storage[name] and tensor.tolist() == [2.0, 2.0]  # a copy, the new values
            reload(iter([(name, tensor)]), is_checkpoint_format)
            del tensor  # vLLM copied it into its parameter: the next copy is made only now

    served.worker.reload_weights = reload_counting_copies
    served.update_weights(update)
    assert served.load() and served.version == 2 and held(served) == {n: [2.0, 2.0] for n in NAMES}


def test_a_version_staged_while_one_is_written_is_written_next(served):
    served.update_weights(whole(1, 1.0))
    reload = served.worker.reload_weights

    def reload_while_a_version_arrives(weights_iterator, is_checkpoint_format):
        served.update_weights(whole(2, 2.0))  # the follower's thread, meanwhile
        reload(weights_iterator, is_checkpoint_format)

    served.worker.reload_weights = reload_while_a_version_arrives
    assert served.load() and served.version == 1 and served.staged_version == 2
    served.worker.reload_weights = reload
    assert served.load() and served.version == 2 and held(served) == {n: [2.0, 2.0] for n in NAMES}


def test_a_version_that_stays_unavailable_is_reported_as_weights_stale(served, tmp_path):
    config = SyncConfig(store=str(tmp_path / "weights"), publish_dtype="keep", unavailable_after=0.0)
    store = WeightStore.open(config)
    publisher = Publisher(store, config)
    publisher.publish({n: torch.zeros(2) for n in NAMES})  # version 0, as vLLM loaded it
    subscriber = Subscriber(store, config)
    assert subscriber.poll() == 0
    extension = WeightStoreFollower()
    extension._whetstone = WeightFollower(subscriber, served)
    chunk = store.objects.root / publisher.publish({n: torch.ones(2) for n in NAMES}).chunks[0].key
    saved = chunk.read_bytes()
    chunk.unlink()  # deleted for good, or a partial copy
    assert subscriber.poll() == 0
    health = health_of(extension.whetstone_status())
    assert health["status"] == "weights stale" and health["weight_version"] == 0
    assert "version 1 has been unavailable" in health["weights_problem"]

    chunk.write_bytes(saved)
    assert subscriber.poll() == 1
    served.update_weights(subscriber.take_update())
    assert served.load() and extension.whetstone_status()["weights_problem"] is None
    assert held(served) == {n: [1.0, 1.0] for n in NAMES}


class FakeVllm:
    """vLLM's development routes, recorded: the worker has version 2 staged; `whetstone_apply`
    fails (HTTP 500: the model holds no whole version) while `failing`, else answers `applied`."""

    def __init__(self):
        self.calls: list[str] = []
        self.failing = True
        self.applied = {"weight_version": 2, "written": True}
        self.lock = threading.Lock()

    def __call__(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content) if request.content else {}
        call = body.get("method") or request.url.path
        if request.url.path == "/update_weight_version":
            call += f"={body['new_version']}"
        with self.lock:
            self.calls.append(call)
        if call == "whetstone_apply":
            if self.failing == "malformed":  # an answer the driver cannot read
                return httpx.Response(200, text="not json")
            if self.failing:
                return httpx.Response(500, json={"error": "out of memory (simulated)"})
            return httpx.Response(200, json={"results": [self.applied]})
        if call in ("whetstone_follow", "whetstone_status"):
            return httpx.Response(200, json={"results": [{"following": True, "staged_version": 2}]})
        return httpx.Response(200, json={})


def driver_of(vllm: FakeVllm, **options) -> SwapDriver:
    driver = SwapDriver("http://vllm:8000", "{}", version=1, poll_s=0.01, **options)
    driver.client = httpx.Client(base_url=driver.root, transport=httpx.MockTransport(vllm))
    return driver


def test_a_failed_swap_leaves_vllm_paused_until_a_retry_goes_through():
    vllm = FakeVllm()
    driver = driver_of(vllm)
    with pytest.raises(httpx.HTTPStatusError):
        driver.swap()
    assert vllm.calls == ["/pause", "whetstone_apply"]  # no /resume: the model may hold a mix
    assert driver.paused and driver._retry_at > 0

    vllm.calls.clear()
    vllm.failing = False
    driver.swap()
    assert vllm.calls == ["whetstone_apply", "/update_weight_version=2", "/resume"]
    assert not driver.paused


def test_an_answer_the_driver_cannot_read_is_retried_later_not_at_the_next_poll():
    vllm = FakeVllm()
    vllm.failing = "malformed"
    driver = driver_of(vllm)
    before = time.monotonic()
    with pytest.raises(ValueError):  # json's error
        driver.swap()
    assert driver.paused and driver._retry_at >= before + driver.retry_first_s


def test_a_version_that_could_not_be_written_resumes_vllm_on_the_last_good_one_and_is_retried_later():
    vllm = FakeVllm()
    vllm.failing, vllm.applied = False, {"weight_version": 1, "written": False}
    driver = driver_of(vllm)
    before = time.monotonic()
    driver.swap()
    assert vllm.calls == ["/pause", "whetstone_apply", "/update_weight_version=1", "/resume"]
    assert not driver.paused  # requests are served, by version 1
    assert driver._retry_at >= before + driver.retry_first_s  # not at the next poll: backing off
    assert driver._retry_in == 2 * driver.retry_first_s


@pytest.mark.parametrize("failing", [True, "malformed"], ids=["no whole version", "an answer it cannot read"])
def test_vllm_paused_longer_than_the_limit_stops_the_server(failing):
    vllm = FakeVllm()  # every write leaves the model holding no whole version, or answers nonsense
    vllm.failing = failing
    driver = driver_of(vllm, pause_limit_s=0.2)
    driver.retry_first_s = driver._retry_in = 0.01
    stopped = threading.Event()
    driver.stop_server = stopped.set  # in the server: SIGTERM to itself, vLLM aborting what waits
    driver.start()
    assert stopped.wait(30), "vLLM stayed paused past the limit"
    with vllm.lock:
        calls = list(vllm.calls)
    assert calls.count("/pause") == 1 and "/resume" not in calls and calls.count("whetstone_apply") > 1


class FakeGauge:
    """prometheus_client's `Gauge` and `Counter` as `WeightGauges` uses them (vLLM's environment
    has the real ones): each series' value by its label values (the model's alone: its name), in
    `values` under the metric's name (a counter's with `_total`, as exposed)."""

    values: dict[str, dict[str, float]] = {}

    def __init__(self, name: str, help_text: str, labelnames: list[str], multiprocess_mode: str = "all"):
        assert labelnames[0] == "model" and help_text
        self.name, self.labelnames = name, labelnames

    def labels(self, **labels: str) -> SimpleNamespace:
        assert list(labels) == self.labelnames
        key = labels["model"] if len(labels) == 1 else tuple(labels.values())
        series = self.values.setdefault(self.name, {})
        return SimpleNamespace(
            set=lambda value: series.__setitem__(key, value),
            inc=lambda amount: series.__setitem__(key, series.get(key, 0) + amount),
        )

    def remove(self, *labelvalues: str) -> None:
        del self.values[self.name][labelvalues]


class FakeCounter(FakeGauge):
    def __init__(self, name: str, help_text: str, labelnames: list[str]):
        super().__init__(name + "_total", help_text, labelnames)


def test_the_weight_gauges_say_what_the_worker_serves_and_whether_it_is_stale(monkeypatch):
    monkeypatch.setitem(sys.modules, "prometheus_client", SimpleNamespace(Gauge=FakeGauge, Counter=FakeCounter))
    monkeypatch.setattr(FakeGauge, "values", {})
    vllm = FakeVllm()
    vllm.failing = False
    driver = driver_of(vllm, gauges=WeightGauges("m"))
    failed = "writing weight version 2 failed (RuntimeError: out of memory): serving version 1 until it is written"
    vllm.applied = {"following": True, "weight_version": 1, "latest_weight_version": 2, "weights_problem": failed}
    vllm.applied |= {"written": False, "rejections_total": 2, "rejected_versions": {"2": "refused", "3": "corrupt"}}
    driver.swap()  # vLLM resumes on version 1, which the gauges say, stale, with the versions it rejected
    gauges = {"whetstone_weight_version": 1, "whetstone_weight_version_latest": 2, "whetstone_weights_stale": 1}
    gauges |= {"whetstone_weight_versions_rejected_total": 2}
    rejected = {("m", "2"): 1, ("m", "3"): 1}
    assert FakeGauge.values == {name: {"m": value} for name, value in gauges.items()} | {
        "whetstone_weight_version_rejected": rejected
    }

    vllm.applied = {"following": True, "weight_version": 4, "latest_weight_version": 4, "weights_problem": None}
    vllm.applied |= {"rejections_total": 3, "rejected_versions": {}}  # one more rejection, then served past
    driver.swap()
    gauges = {"whetstone_weight_version": 4, "whetstone_weight_version_latest": 4, "whetstone_weights_stale": 0}
    gauges |= {"whetstone_weight_versions_rejected_total": 3}
    assert FakeGauge.values == {name: {"m": value} for name, value in gauges.items()} | {
        "whetstone_weight_version_rejected": {}
    }


def test_a_pause_limit_that_is_not_positive_is_refused(capsys):
    with pytest.raises(SystemExit):
        parse(["--model", "m", "--pause-limit", "0"])
    assert "--pause-limit must be positive seconds, got 0.0" in capsys.readouterr().err


def test_a_stopped_server_that_does_not_exit_is_ended_after_the_grace(monkeypatch):
    """uvicorn's shutdown waits for every connection: one held by the stopped engine would keep
    the server up (and its waiting requests waiting) for ever."""
    from whetstone.integrations import vllm_serve

    signals, exits = [], []
    monkeypatch.setattr(vllm_serve, "STOP_GRACE_S", 0.05)
    monkeypatch.setattr(vllm_serve.os, "kill", lambda pid, number: signals.append(number))
    monkeypatch.setattr(vllm_serve.os, "_exit", exits.append)
    monkeypatch.setattr(vllm_serve.atexit, "_run_exitfuncs", lambda: None)
    driver = vllm_serve.SwapDriver("http://vllm:8000", "{}", version=1, poll_s=0.01)
    driver.stop_server()
    deadline = time.monotonic() + 10
    while not exits and time.monotonic() < deadline:
        time.sleep(0.01)
    assert driver.failed and signals == [signal.SIGTERM] and exits == [1]


@pytest.mark.parametrize(
    ("argv", "name"),
    [
        (["--model", "/m"], "/m"),
        (["--model", "/m", "--served-model-name", "coder"], "coder"),
        (["--model", "/m", "--", "--served-model-name", "coder", "alias"], "coder"),
        (["--model", "/m", "--", "--max-model-len", "64", "--served-model-name=coder"], "coder"),
        (["--model", "/m", "--", "--served_model_name", "coder"], "coder"),
    ],
)
def test_the_gauges_model_label_is_the_name_vllm_serves(argv, name):
    assert served_model_name(parse(argv)) == name


def test_a_served_model_name_given_twice_is_refused(capsys):
    with pytest.raises(SystemExit):
        parse(["--model", "/m", "--served-model-name", "a", "--", "--served-model-name", "b"])
    assert "--served-model-name is given both before and after --" in capsys.readouterr().err


def test_a_status_without_a_version_or_a_mistyped_address_is_no_version_or_down_not_a_crash():
    assert health_of({"following": True}) == {}  # following, but no version to report: as a vLLM without it

    async def ask(url: str):
        async with httpx.AsyncClient() as client:
            return await vllm_health(client, url)

    assert asyncio.run(ask("http://gpu-3:$PORT/v1")) is None  # an address no server can have: down


def test_a_failed_swap_is_retried_at_the_pause_limit_not_after_the_retry_wait():
    """vLLM stays paused at most the limit: the retry that would come after it comes at it, and
    when that one fails too the server stops."""
    vllm = FakeVllm()
    driver = driver_of(vllm, pause_limit_s=0.2)
    driver.retry_first_s = driver._retry_in = 60.0  # the longest wait, which the limit cuts short
    stopped = threading.Event()
    driver.stop_server = stopped.set
    driver.start()
    assert stopped.wait(30), "vLLM stayed paused until the retry's wait ended, past the limit"
    with vllm.lock:
        assert (
            vllm.calls.count("whetstone_apply") == 2 and "/resume" not in vllm.calls
        )  # the first try, and one at the limit


@pytest.mark.parametrize(
    ("argv", "error"),
    [
        (["--sync", "{store: 'w'}"], "invalid config (--sync, a SyncConfig as JSON):\n  config: Invalid JSON"),
        (["--sync", '{"stroe": "w"}'], "stroe: Extra inputs are not permitted"),
        (
            ["--sync", '{"store": "w"}', "--fleet", '{"announce": tru'],
            "invalid config (--fleet, a FleetConfig as JSON)",
        ),
        (["--fleet", '{"announce": true}'], "--fleet needs --sync"),
        (["--poll-interval", "0"], "--poll-interval must be positive seconds, got 0.0"),
        (["--poll-interval", "-1"], "--poll-interval must be positive seconds, got -1.0"),
        (["--pause-limit", "nan"], "--pause-limit must be positive seconds, got nan"),
        (["--poll-interval", "inf"], "--poll-interval must be positive seconds, got inf"),
        (["--weight-version", "-1"], "--weight-version must be 0 or more, got -1"),
    ],
)
def test_launcher_options_that_cannot_work_are_refused_before_vllm_starts(argv, error, capsys):
    with pytest.raises(SystemExit) as stopped:
        parse(["--model", "/m", *argv])
    assert stopped.value.code == 2 and error in capsys.readouterr().err


@pytest.mark.parametrize(
    ("args", "flag"),
    [
        (["--port", "9000"], "--port"),  # vLLM would listen where the swap thread never looks
        (["--max-model-len", "64", "--host=0.0.0.0"], "--host"),
        (["--model", "/other"], "--model"),
        (["--logprobs_mode", "raw_logprobs"], "--logprobs-mode"),  # not what the trainer computes
    ],
)
def test_vllm_options_the_launcher_sets_are_refused_after_the_dashes(args, flag, capsys):
    with pytest.raises(SystemExit):
        parse(["--model", "/m", "--", *args])
    assert f"{flag} among vLLM's arguments after --" in capsys.readouterr().err
    extension = ["--worker-extension-cls", "vllm_faults.FaultyWrites"]  # vLLM's own, or replacing the launcher's
    assert parse(["--model", "/m", "--", "--dtype", "bfloat16", *extension]).vllm_args[-1] == "vllm_faults.FaultyWrites"


def test_a_fleet_registry_that_does_not_exist_is_an_error_not_a_traceback(tmp_path):
    import subprocess

    import whetstone

    sync = json.dumps({"store": str(tmp_path / "missing")})
    command = [sys.executable, "-m", "whetstone.integrations.vllm_serve", "--model", "/m", "--sync", sync]
    env = {"PYTHONPATH": str(Path(whetstone.__file__).parents[1]), "PATH": "/usr/bin:/bin"}
    done = subprocess.run([*command, "--fleet", '{"announce": true}'], capture_output=True, text=True, env=env)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.startswith(f"error: no store at {tmp_path / 'missing'}")


def test_a_worker_too_busy_to_report_is_up_and_an_unreachable_one_down():
    """vLLM's engine runs one worker call at a time: while it writes a weight version the status
    call waits, and a health check that gives up waiting must not take the server for dead."""

    def vllm(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/health":
            return httpx.Response(200)
        raise failure("no answer (simulated)", request=request)

    async def ask():
        async with httpx.AsyncClient(transport=httpx.MockTransport(vllm)) as client:
            return await vllm_health(client, "http://vllm:8000/v1")

    failure = httpx.ReadTimeout
    assert asyncio.run(ask()) == {}
    failure = httpx.ConnectError
    assert asyncio.run(ask()) is None


class PausingVllm(FakeVllm):
    """vLLM whose /pause pauses its scheduler (as vLLM 0.32 does before it drains and answers),
    then fails: `pause_fails` is a timeout (a drain longer than the driver waits) or an error."""

    def __init__(self, pause_fails):
        super().__init__()
        self.failing, self.pause_fails, self.scheduler_paused = False, pause_fails, False

    def __call__(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/pause":
            self.scheduler_paused = True
            with self.lock:
                self.calls.append("/pause")
            if self.pause_fails == "timeout":
                raise httpx.ReadTimeout("timed out", request=request)
            if self.pause_fails:
                return httpx.Response(500, json={"error": "Failed to pause generation: (simulated)"})
            return httpx.Response(200, json={"status": "paused"})
        if request.url.path == "/resume":
            self.scheduler_paused = False
        return super().__call__(request)


def test_a_pause_that_fails_resumes_vllm_instead_of_leaving_it_paused_past_the_limit():
    vllm = PausingVllm(pause_fails=True)  # every /pause fails, after pausing the scheduler
    driver = driver_of(vllm, pause_limit_s=0.2)
    with pytest.raises(httpx.HTTPStatusError):
        driver.swap()
    assert vllm.calls == ["/pause", "/resume"] and not vllm.scheduler_paused and not driver.paused

    vllm.calls.clear()  # run: vLLM serves between the retries, and none counts as paused
    driver.retry_first_s = driver._retry_in = driver.retry_max_s = 0.01
    driver._retry_at = 0.0
    stopped = threading.Event()
    driver.stop_server = stopped.set
    driver.start()
    time.sleep(0.5)
    driver.failed = True  # ends the thread
    assert not stopped.is_set() and not vllm.scheduler_paused
    with vllm.lock:
        assert vllm.calls.count("/pause") > 1 and vllm.calls.count("/pause") == vllm.calls.count("/resume")


def test_a_pause_that_timed_out_leaves_vllm_draining_for_the_next_pause_to_wait_for():
    vllm = PausingVllm(pause_fails="timeout")
    driver = driver_of(vllm)
    with pytest.raises(httpx.ReadTimeout):
        driver.swap()
    assert vllm.calls == ["/pause"] and vllm.scheduler_paused and not driver.paused
    vllm.pause_fails = False
    driver.swap()
    assert vllm.calls == ["/pause", "/pause", "whetstone_apply", "/update_weight_version=2", "/resume"]
    assert not vllm.scheduler_paused


def test_a_pause_that_keeps_timing_out_stops_the_server_at_the_limit():
    """A drain that never ends keeps vLLM closed to new requests: the drain limit holds, counted
    from the first /pause, and a /pause waits no longer than what is left of it."""
    vllm = PausingVllm(pause_fails="timeout")
    driver = driver_of(vllm, pause_limit_s=0.1)
    assert driver.drain_limit_s == 600.0  # a drain is requests in flight finishing: the longer limit
    driver.drain_limit_s = 0.3
    driver.retry_first_s = driver._retry_in = driver.retry_max_s = 0.01
    stopped = threading.Event()
    driver.stop_server = stopped.set
    driver.start()
    assert stopped.wait(30), "vLLM stayed paused, draining, past the limit"
    with vllm.lock:
        assert vllm.calls.count("/pause") >= 1 and "whetstone_apply" not in vllm.calls and "/resume" not in vllm.calls
    assert driver._pause_wait_s() == 1.0  # a /pause now would wait no more than the least
