"""`whetstone bench ...` refuses a count or a duration that means nothing (negative, zero, not
finite) before anything starts, naming the option and its value. The first step each benchmark
takes is replaced by one that fails the test, so a value let through shows as "started"."""

from __future__ import annotations

import re

import pytest
from typer.testing import CliRunner

from whetstone.bench.cli import app
from whetstone.errors import WhetstoneError

FIRST_STEP = {
    "inference": "whetstone.bench.inference.configure_process",
    "train": "whetstone.bench.train.configure_process",
    "consistency": "whetstone.bench.consistency.configure_process",
    "gpu": "whetstone.bench.gpu.configure_process",
    "fleet": "whetstone.bench.fleet.Fleet",
    "vllm": "whetstone.integrations.vllm.vllm_python",
    "online": "whetstone.bench.online._Bench.run",
    "sandbox": "whetstone.bench.sandbox._runtime",
}
"""Each benchmark's first step past its checks."""


class Started(Exception):
    """The benchmark went past its checks."""


def _started(*_args, **_kwargs):
    raise Started


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["inference", "--new-tokens", "0"], "new_tokens must be >= 1, got 0"),
        (["inference", "--new-tokens", "-5"], "new_tokens must be >= 1, got -5"),
        (["inference", "--threads", "-1"], "threads must be >= 0, got -1"),
        (["train", "--threads", "-1"], r"threads must be >= 0 \(0: every core\), got -1"),
        (["consistency", "--threads", "-2"], "threads must be >= 0, got -2"),
        (["consistency", "--rounds", "0"], "rounds must be >= 1, got 0"),
        (["gpu", "--model", "tiny", "--threads", "-1"], "threads must be >= 0, got -1"),
        (["fleet", "--servers", "-1"], "servers must be >= 1, got -1"),
        (["fleet", "--servers", "2", "--servers", "0"], "servers must be >= 1, got 0"),
        (["fleet", "--rollouts-per-server", "0"], "rollouts_per_server must be >= 1, got 0"),
        (["fleet", "--behind", "0"], "behind must be >= 1, got 0"),
        (["fleet", "--loss-rollouts", "-1"], "loss_rollouts must be >= 1, got -1"),
        (["vllm", "--tasks", "0"], "tasks must be >= 1, got 0"),
        (["vllm", "--samples", "0"], "samples must be >= 1, got 0"),
        (["vllm", "--max-tokens", "-1"], "max_tokens must be >= 1, got -1"),
        (["vllm", "--concurrency", "0"], "concurrency must be >= 1, got 0"),
        (["vllm", "--versions", "0"], "versions must be >= 1, got 0"),
        (["online", "--lr", "0"], "bench online: lr = 0.0: must be a finite number > 0"),
        (["online", "--lr", "nan"], "bench online: lr = nan: must be a finite number > 0"),
        (["online", "--logit-scale-lr", "-0.1"], r"bench online: logit_scale_lr = -0.1: must be a finite number >= 0"),
        (["sandbox", "--duration-s", "inf"], "duration_s must be a finite number of seconds, got inf"),
    ],
)
def test_a_meaningless_number_is_refused_before_anything_starts(args, message, monkeypatch, tmp_path):
    monkeypatch.setattr(FIRST_STEP[args[0]], _started)
    if args[0] == "online":  # a model folder, so that only the option is wrong
        (tmp_path / "model").mkdir()
        (tmp_path / "model" / "config.json").write_text("{}")
        args = [*args, "--model", str(tmp_path / "model"), "--output-dir", str(tmp_path / "out")]
    result = CliRunner().invoke(app, args)
    assert isinstance(result.exception, WhetstoneError), repr(result.exception)
    assert re.search(message, str(result.exception)), str(result.exception)
