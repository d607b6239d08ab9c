"""A vLLM OpenAI server that follows whetstone's weight store, as `whetstone serve` does.

Run it with the vLLM virtual environment's python and whetstone importable (`whetstone run` with
`servers.engine = "vllm"` does; `whetstone.integrations.vllm.serve_command` builds the line):

    PYTHONPATH=<whetstone> /path/venv-vllm/bin/python -m whetstone.integrations.vllm_serve \\
        --model runs/default/midtrain/model --port 8000 --sync '{"store": "runs/default/weights"}' \\
        -- --max-model-len 2048

It runs vLLM's own `vllm.entrypoints.openai.api_server` in this process with what RL needs:
`--enable-scale-out` (the token-in/token-out `/inference/v1/generate` route, which returns the
weight version of every token), `--logprobs-mode processed_logprobs` (logprobs of the distribution
sampled, after temperature, as the trainer computes them), whetstone's worker extension
(`vllm_worker.WeightStoreFollower`) and `VLLM_SERVER_DEV_MODE=1` (the `/collective_rpc`, `/pause`,
`/resume` and `/update_weight_version` routes: bind it to a trusted network only). Arguments after
`--` go to vLLM as they are.

A thread of this process drives the weight swaps over vLLM's HTTP routes: once the server is up it
tags the loaded weights with `--weight-version` and starts the worker's store follower; then,
whenever the worker has staged a new version: `/pause?mode=wait` (running requests finish, none
starts, vLLM clears its prefix cache, so no request continues on a cache of older weights), the
worker writes it in place, `/update_weight_version` tags what follows, `/resume`. Every completion
is therefore sampled by one version, and `/inference/v1/generate` reports it per token.

A version whose write fails is handled as `whetstone serve` handles one its engine refuses: the
worker writes the served version back, vLLM resumes on it (its /health, as the server pool reads
it through `whetstone_status`, says "weights stale" and why) and the write is tried again after
1 s, then doubling up to 60 s, for as long as it fails. A swap that cannot resume vLLM on a whole,
rightly tagged version (writing the served version back failed too, a route did not answer)
leaves vLLM paused, since its model may hold parts of two versions or an old version's tag, and is
retried the same way, the last time once vLLM has been paused `--pause-limit` seconds: if that
fails too, the server stops (exit 1), failing the requests that waited, for its supervisor to
start it afresh.

With `--fleet` (a `FleetConfig` as JSON, `announce = true`), the same thread then announces the
server in the fleet registry, as `whetstone serve` does, until the process exits: how a run on Ray
(`run/ray_launch.py`) lets its orchestrator find vLLM servers it placed on other nodes.

The thread also keeps whetstone's weight gauges on vLLM's `/metrics`, named as `whetstone serve`'s
(`whetstone_weight_version`, `whetstone_weight_version_latest`, `whetstone_weights_stale`), so an
alert on stale weights covers a fleet of either engine.
"""

from __future__ import annotations

import argparse
import atexit
import logging
import math
import os
import runpy
import signal
import sys
import threading
import time
import warnings
from pathlib import Path
from typing import Any

import httpx
from pydantic import ValidationError

from whetstone.config import format_validation_error
from whetstone.errors import AccessDeniedError, WhetstoneError
from whetstone.fleet.config import FleetConfig
from whetstone.sync.config import SyncConfig

EXTENSION = "whetstone.integrations.vllm_worker.WeightStoreFollower"
STATUS_TIMEOUT_S = 10.0
"""How long a poll for a staged version waits (a swap's own calls wait as long as draining takes)."""
STOP_GRACE_S = 15.0
"""How long a server `SwapDriver.stop_server` stopped may take to exit before it is ended at once."""
PAUSE_LIMIT_S = 120.0
"""How long swaps that do not go through may keep vLLM paused before the server is stopped: long
enough for seven retries, at 1, 3, 7 ... 63 s, the last at the limit itself."""
DRAIN_LIMIT_S = 600.0
"""How long vLLM may drain the requests in flight for a swap's /pause (their generations
finishing, new requests waiting) before the server is stopped, where the pause limit is shorter:
a drain is work going on; only one that never ends (an engine that hangs) meets it."""
log = logging.getLogger("whetstone.vllm")


class WeightGauges:
    """whetstone's weight gauges on vLLM's `/metrics`, named, labelled and explained as `whetstone
    serve`'s (inference/metrics.py): the version served and, once following a store, the store's
    newest, whether the server cannot take it, and the versions it rejected.

    They are prometheus_client gauges of this process's default registry, the one vLLM's
    `/metrics` serves when it runs one API server (as here). With $PROMETHEUS_MULTIPROC_DIR set
    before the start, prometheus_client writes every gauge to that folder and vLLM serves the
    folder's metrics instead: these gauges are there too ("livemostrecent": this process's last
    value)."""

    def __init__(self, model: str):
        """`model`: the model id of the API (the `model` label of `whetstone serve`'s metrics)."""
        from prometheus_client import Counter, Gauge

        def gauge(name: str, help_text: str, labels: tuple[str, ...] = ()):
            return Gauge(f"whetstone_{name}", help_text, ["model", *labels], multiprocess_mode="livemostrecent")

        self.model = model
        self.version = gauge("weight_version", "Weight version being served.")
        self.latest = gauge("weight_version_latest", "Newest weight version in the store.")
        self.stale = gauge("weights_stale", "1 while the server cannot take the newest weight version.")
        self.rejections = Counter(
            "whetstone_weight_versions_rejected",  # exposed with `_total`, as whetstone serve's counter
            "Weight versions rejected (corrupt, wrong base) or refused by the engine.",
            ["model"],
        )
        self.rejected = gauge(
            "weight_version_rejected", "Rejected weight versions newer than the one served.", ("version",)
        )
        self._rejections_seen = 0
        self._rejected_shown: set[str] = set()

    def serving(self, version: int) -> None:
        """The weights loaded at start are tagged `version`."""
        self.version.labels(model=self.model).set(version)

    def record(self, status: dict) -> None:
        """The worker's `whetstone_status`."""
        if not status.get("following"):
            return
        self.version.labels(model=self.model).set(status["weight_version"])
        if status.get("latest_weight_version") is not None:
            self.latest.labels(model=self.model).set(status["latest_weight_version"])
        self.stale.labels(model=self.model).set(int(bool(status.get("weights_problem"))))
        total = status.get("rejections_total") or 0
        if total > self._rejections_seen:
            self.rejections.labels(model=self.model).inc(total - self._rejections_seen)
            self._rejections_seen = total
        rejected = set(status.get("rejected_versions") or {})
        for version in rejected:
            self.rejected.labels(model=self.model, version=version).set(1)
        for version in self._rejected_shown - rejected:  # served past, or taken after a repair
            self.rejected.labels(model=self.model, version=version).set(0)  # what a multiprocess folder keeps
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # multiprocess mode: "removal ... not implemented"
                self.rejected.remove(self.model, version)
        self._rejected_shown = rejected


def _exit_now(message: str) -> None:
    """End the process with 1 after `message` (% STOP_GRACE_S), its exit handlers run first."""
    log.error(message + ": exiting now", STOP_GRACE_S)
    try:
        atexit._run_exitfuncs()
    finally:
        os._exit(1)


def served_model_name(options: argparse.Namespace) -> str:
    """The model id the API serves, as vLLM picks it: the first name of `--served-model-name`,
    given before `--` or among vLLM's own arguments after it, else the model folder."""
    if options.served_model_name:
        return options.served_model_name
    args = options.vllm_args
    for index, arg in enumerate(args):
        flag, given, value = arg.partition("=")
        if vllm_flag(flag) == "--served-model-name":
            if given:
                return value
            if index + 1 < len(args) and not args[index + 1].startswith("-"):
                return args[index + 1]
    return options.model


def vllm_flag(arg: str) -> str:
    """The option `arg` (`--name` or `--name=value`) names, as vLLM reads it: vLLM also takes
    its options spelled with `_`."""
    return arg.partition("=")[0].replace("_", "-")


LAUNCHER_FLAGS = {
    "--host": "give it before -- (the launcher reaches vLLM there to swap its weights)",
    "--port": "give it before -- (the launcher reaches vLLM there to swap its weights)",
    "--model": "give it before --",
    "--logprobs-mode": "the launcher sets processed_logprobs, the logprobs the trainer computes",
}
"""vLLM options the launcher sets itself, refused among vLLM's arguments after `--`: vLLM takes
the last one given, and would listen where the swap thread never looks, or return logprobs the
trainer does not compute, without a word."""


def vllm_argv(options: argparse.Namespace) -> list[str]:
    """vLLM's command line for `options`."""
    return [
        "--model",
        options.model,
        "--host",
        options.host,
        "--port",
        str(options.port),
        "--dtype",
        options.dtype,
        "--enable-scale-out",
        "--logprobs-mode",
        "processed_logprobs",
        "--worker-extension-cls",
        EXTENSION,
        *(["--served-model-name", options.served_model_name] if options.served_model_name else []),
        *options.vllm_args,
    ]


class SwapDriver:
    """The thread that swaps weights: waits for the server, starts the worker's follower and the
    fleet announcer (if any), and applies each version the worker stages, with the scheduler
    paused."""

    def __init__(
        self,
        root: str,
        sync_json: str | None,
        version: int,
        poll_s: float,
        announcer: Any = None,
        pause_limit_s: float = PAUSE_LIMIT_S,
        gauges: WeightGauges | None = None,
    ):
        self.root, self.sync_json, self.version, self.poll_s = root, sync_json, version, poll_s
        self.announcer = announcer
        """A `fleet.Announcer`, started once the server answers and follows the store."""
        self.gauges = gauges
        """The weight gauges on vLLM's /metrics, set from every status the worker reports."""
        self.pause_limit_s = pause_limit_s
        """How long vLLM may stay paused by swaps that do not go through before the server is stopped."""
        self.failed = False
        """Whether following the store, announcing or swapping failed for good (the server was
        stopped for it)."""
        self.paused = False
        """vLLM's scheduler is paused by a swap that has not gone through yet."""
        from whetstone.inference.swap import RETRY_FIRST_S, RETRY_MAX_S

        self.retry_first_s, self.retry_max_s = RETRY_FIRST_S, RETRY_MAX_S
        """How soon a failed swap is tried again, and how far the wait doubles to (as the store
        follower retries a version the engine refused)."""
        self._retry_at, self._retry_in = 0.0, RETRY_FIRST_S
        self._paused_at = 0.0
        self.drain_limit_s = max(pause_limit_s, DRAIN_LIMIT_S)
        """How long vLLM may drain for /pause requests that time out before the server is stopped."""
        self._draining_since: float | None = None
        """When the first of the /pause requests that timed out was sent, vLLM still draining
        (closed to new requests), until a /pause goes through or vLLM resumes."""
        self.client = httpx.Client(base_url=root, timeout=600.0)

    def start(self) -> None:
        threading.Thread(target=self._run, name="whetstone-swaps", daemon=True).start()

    def rpc(self, method: str, *args: str, timeout: float | None = None) -> dict:
        """The worker's answer to `method` (one worker: tensor and pipeline parallelism are not
        supported), waited for `timeout` seconds (None: the client's)."""
        wait = httpx.USE_CLIENT_DEFAULT if timeout is None else timeout
        response = self.client.post("/collective_rpc", json={"method": method, "args": list(args)}, timeout=wait)
        response.raise_for_status()
        return response.json()["results"][0]

    def post(self, path: str, **body) -> None:
        self.client.post(path, json=body or None).raise_for_status()

    def _wait_for_server(self) -> None:
        while True:
            try:
                if self.client.get("/health").status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(self.poll_s)

    def stop_server(self) -> None:
        """Stop vLLM (its engine aborts the requests it holds); `main` then exits with 1. A server
        still up `STOP_GRACE_S` later (uvicorn's shutdown waits for every connection to close, and
        a request held by the stopped engine may never end) exits at once, with 1, its exit
        handlers run (the fleet record removed)."""
        self.failed = True
        watchdog = threading.Timer(STOP_GRACE_S, _exit_now, args=("the server did not stop within %g s",))
        watchdog.daemon = True
        watchdog.start()
        os.kill(os.getpid(), signal.SIGTERM)

    def _run(self) -> None:
        try:
            self._start()
        except Exception:  # unfollowing or unannounced, the server would answer but never be right or used
            log.exception("could not follow the weight store or announce the server: stopping it")
            self.stop_server()
            return
        if self.sync_json is None:
            return
        while not self.failed:
            try:
                # bounded: a poll in flight when vLLM stops its engine never gets an answer, and
                # uvicorn's shutdown would wait for it until the process is killed (its fleet
                # record left behind)
                status = self.rpc("whetstone_status", timeout=STATUS_TIMEOUT_S)
                self._record(status)
                if (status.get("staged_version") is not None or self.paused) and time.monotonic() >= self._next_try():
                    self.swap()
            except Exception as err:  # a busy or restarting engine, an odd answer: try again at the next poll
                # (any error: the thread ending would leave a paused vLLM paused past its limit)
                log.warning("weight swap check failed: %s: %s", type(err).__name__, err)
                since = self._paused_since()
                if since is not None and time.monotonic() - since >= self._limit_s():
                    log.error(
                        "vLLM has been paused for %.0f s by weight swaps that do not go through: stopping the server",
                        time.monotonic() - since,
                    )
                    self.stop_server()
                    return
            time.sleep(self.poll_s)

    def _start(self) -> None:
        """Once the server answers: tag its weights, follow the store, announce it (its record
        removed at exit, with the server)."""
        self._wait_for_server()
        self.post("/update_weight_version", new_version=str(self.version))
        if self.gauges is not None:
            self.gauges.serving(self.version)
        if self.sync_json is not None:
            self._record(self.rpc("whetstone_follow", self.sync_json, str(self.version)))
            log.info("following the weight store from version %d", self.version)
        if self.announcer is not None:
            self.announcer.start()
            atexit.register(self.announcer.stop)

    def swap(self) -> None:
        """Pause vLLM, have the worker write its staged version, tag what the model holds, resume.

        When the write fails the worker writes the served version back: vLLM resumes on it, and
        the worker keeps the update staged and reports the failure in `whetstone_status` (the
        server pool reads it as "weights stale"). vLLM resumes only on a whole version under its
        own tag: on an error (writing the served version back failed too, a route did not answer)
        it stays paused, since its model may hold parts of two versions, and the error is raised.
        A /pause that fails is answered with /resume (`_resume_unswapped`), except one that timed
        out: vLLM is still draining, paused, and the next swap's /pause waits for that drain.
        Either way the next swap comes `retry_first_s` later, the wait doubling to `retry_max_s`;
        `_run` stops the server once vLLM has been paused `pause_limit_s`, or has drained for
        /pause requests that time out `drain_limit_s`."""
        started = time.perf_counter()
        state = "vLLM stays paused"
        try:
            if not self.paused:
                sent = time.monotonic()
                try:
                    self.client.post(
                        "/pause", params={"mode": "wait", "clear_cache": "true"}, timeout=self._pause_wait_s()
                    ).raise_for_status()
                except httpx.ReadTimeout:
                    state = "vLLM stays paused, draining: the next /pause waits for the same drain"
                    if self._draining_since is None:
                        self._draining_since = sent
                    raise
                except Exception:
                    state = self._resume_unswapped()
                    raise
                self.paused, self._paused_at, self._draining_since = True, time.monotonic(), None
            answer = self.rpc("whetstone_apply")
            version = answer["weight_version"]
            self.post("/update_weight_version", new_version=str(version))
            self.post("/resume")
        except Exception as err:  # an HTTP error, or an answer it cannot read
            log.error(
                "weight swap failed (%s; retried in %.0f s): %s: %s",
                state,
                self._retry_in,
                type(err).__name__,
                err,
            )
            self._retry_later()
            raise
        self.paused = False
        self._record(answer)
        if answer.get("written", True):
            self._retry_in = self.retry_first_s
            log.info("weight version %s served (paused %.3f s)", version, time.perf_counter() - started)
        else:
            log.error("serving weight version %s again (write retried in %.0f s)", version, self._retry_in)
            self._retry_later()

    def _resume_unswapped(self) -> str:
        """After a /pause that failed, before anything was written: vLLM may hold the pause
        all the same (vLLM 0.32 pauses its scheduler first, and answers once it has drained),
        and the pause limit counts only pauses that went through, so vLLM would stay paused for
        as long as /pause fails. Its model holds the version it served, whole: /resume. Returns
        the state vLLM is left in, for the log."""
        try:
            self.post("/resume")
        except Exception as err:
            return f"vLLM may stay paused: /resume failed too ({type(err).__name__}: {err})"
        self._draining_since = None
        return "vLLM resumed on the weights it served"

    def _next_try(self) -> float:
        """When the next swap may start: after the retry's wait, and no later than the pause
        limit while vLLM is paused (a wait of up to `retry_max_s` would otherwise keep it paused
        that much past the limit), where a swap that fails too stops the server."""
        since = self._paused_since()
        if since is None:
            return self._retry_at
        return min(self._retry_at, since + self._limit_s())

    def _paused_since(self) -> float | None:
        """Since when vLLM has been paused by swaps (a pause that went through, or a /pause that
        timed out while vLLM drained), or None while it serves."""
        return self._paused_at if self.paused else self._draining_since

    def _limit_s(self) -> float:
        """How long vLLM may stay as it is now: paused by a swap (`pause_limit_s`) or draining for
        one (`drain_limit_s`)."""
        return self.pause_limit_s if self.paused else self.drain_limit_s

    def _pause_wait_s(self) -> float:
        """How long a /pause may wait for vLLM to drain: what is left of the drain limit, counted
        from the first /pause that timed out, so that a drain that never ends meets the limit."""
        since = self._draining_since if self._draining_since is not None else time.monotonic()
        return max(1.0, since + self.drain_limit_s - time.monotonic())

    def _record(self, status: dict) -> None:
        if self.gauges is not None:
            self.gauges.record(status)

    def _retry_later(self) -> None:
        self._retry_at = time.monotonic() + self._retry_in
        self._retry_in = min(self.retry_max_s, 2 * self._retry_in)


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m whetstone.integrations.vllm_serve", description=__doc__)
    parser.add_argument("--model", required=True, help="Hugging Face model folder.")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--dtype", default="float32", help="vLLM's --dtype (float32 matches the trainer on CPU).")
    parser.add_argument("--served-model-name", default="", help="Model id in the API (default: the folder).")
    parser.add_argument("--sync", default=None, help="Weight store to follow: a SyncConfig as JSON (none: fixed).")
    parser.add_argument(
        "--fleet",
        default=None,
        help="The server's FleetConfig as JSON (announced in the registry with announce = true).",
    )
    parser.add_argument("--weight-version", type=int, default=0, help="Weight version of the model loaded.")
    parser.add_argument("--poll-interval", type=float, default=0.2, help="Seconds between checks for a staged version.")
    parser.add_argument(
        "--pause-limit",
        type=float,
        default=PAUSE_LIMIT_S,
        help="Seconds weight swaps that do not go through may keep vLLM paused before the server stops (exit 1).",
    )
    parser.add_argument("vllm_args", nargs=argparse.REMAINDER, help="-- then vLLM's own arguments.")
    options = parser.parse_args(argv)
    if options.vllm_args[:1] == ["--"]:
        options.vllm_args = options.vllm_args[1:]
    flags = [vllm_flag(arg) for arg in options.vllm_args]
    for flag, why in LAUNCHER_FLAGS.items():
        if flag in flags:
            parser.error(f"{flag} among vLLM's arguments after --: {why}")
    if options.served_model_name and "--served-model-name" in flags:
        parser.error("--served-model-name is given both before and after --: give it once")
    # the configs fail here, with what is wrong, not in the worker or the announcer once vLLM has started
    _check_config(parser, "--sync", options.sync, SyncConfig)
    fleet = _check_config(parser, "--fleet", options.fleet, FleetConfig)
    if fleet is not None and fleet.announce and options.sync is None:  # as `whetstone serve`
        parser.error("--fleet needs --sync: a server announces itself where it follows the weights")
    if not 0 < options.poll_interval < math.inf:
        parser.error(f"--poll-interval must be positive seconds, got {options.poll_interval}")
    if not options.pause_limit > 0:  # inf: vLLM stays paused for as long as swaps fail
        parser.error(f"--pause-limit must be positive seconds, got {options.pause_limit}")
    if options.weight_version < 0:
        parser.error(f"--weight-version must be 0 or more, got {options.weight_version}")
    return options


def _check_config(parser: argparse.ArgumentParser, option: str, text: str | None, cls):
    """`text` (the value of `option`, None when not given) as a `cls`, or the parser's error
    naming what is wrong with it."""
    if text is None:
        return None
    try:
        return cls.model_validate_json(text)
    except ValidationError as err:
        parser.error(format_validation_error(err, f"{option}, a {cls.__name__} as JSON"))


def announcer_of(options: argparse.Namespace):
    """The announcer of `--fleet` (None without it), its registry opened here: a wrong one fails
    before vLLM starts. The registry defaults to the weight store of `--sync`."""
    if options.fleet is None:
        return None
    from whetstone.fleet.registry import fleet_announcer

    fleet = FleetConfig.model_validate_json(options.fleet)
    sync = None if options.sync is None else SyncConfig.model_validate_json(options.sync)  # `parse` checked both
    return fleet_announcer(fleet, options.host, options.port, sync)


def main(argv: list[str] | None = None) -> None:
    from whetstone.fleet.registry import api_root
    from whetstone.utils.processes import stop_with_parent

    options = parse(sys.argv[1:] if argv is None else argv)
    stop_with_parent()  # started by a run (`RoleProcess`): no server outlives it
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("whetstone").setLevel(logging.INFO)  # vLLM sets the root logger's level to ERROR as it starts
    whetstone_root = str(Path(__file__).absolute().parents[2])  # vLLM's worker processes import the extension
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (whetstone_root, os.environ.get("PYTHONPATH")) if p)
    os.environ["VLLM_SERVER_DEV_MODE"] = "1"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    try:
        announcer = announcer_of(options)
    except (WhetstoneError, AccessDeniedError) as err:  # its store missing, say: said as the whetstone CLI says it
        print(f"error: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    local = {"0.0.0.0": "127.0.0.1", "": "127.0.0.1", "::": "::1"}.get(
        options.host, options.host
    )  # where the driver reaches it
    driver = SwapDriver(
        api_root(local, options.port).removesuffix("/v1"),
        options.sync,
        options.weight_version,
        options.poll_interval,
        announcer,
        options.pause_limit,
        WeightGauges(served_model_name(options)),
    )
    driver.start()
    sys.argv = ["vllm.entrypoints.openai.api_server", *vllm_argv(options)]
    runpy.run_module("vllm.entrypoints.openai.api_server", run_name="__main__", alter_sys=True)
    if driver.failed:
        raise SystemExit(1)  # a role that failed, not one that ended


if __name__ == "__main__":
    main()
