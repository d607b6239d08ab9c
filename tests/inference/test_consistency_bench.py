"""`whetstone bench consistency`, run tiny: invariant numerics show no mismatch at all, fast
numerics show some, and the JSON carries every figure the docs quote."""

import json

import pytest
from typer.testing import CliRunner

from tests.model.conftest import tiny_config
from whetstone.bench import consistency
from whetstone.bench.cli import app
from whetstone.errors import WhetstoneError

TINY = tiny_config(num_hidden_layers=2, mlp_only_layers=[], max_position_embeddings=256)
FIGURES = {
    "max_abs_logprob_diff",
    "k3_kl",
    "bitwise_equal_fraction",
    "routing_disagreement",
    "overhead_engine",
    "overhead_trainer",
}


def tiny_run(**changes) -> dict:
    arguments = dict(
        threads=1, requests=5, max_batch=2, prompt_tokens=40, new_tokens=12, train_steps=1, rounds=1, config=TINY
    )
    return consistency.run(**(arguments | changes))


def test_invariant_mode_has_no_mismatch_and_fast_mode_has_some():
    result = tiny_run()
    invariant, fast = result["invariant"], result["fast"]
    assert FIGURES <= invariant.keys() and FIGURES <= fast.keys()
    assert invariant["max_abs_logprob_diff"] == 0.0 and invariant["k3_kl"] == 0.0
    assert invariant["bitwise_equal_fraction"] == 1.0 and invariant["routing_disagreement"] == 0.0
    assert fast["bitwise_equal_fraction"] < 1.0 and 0.0 < fast["max_abs_logprob_diff"] < 1e-3
    assert invariant["tokens"] == fast["tokens"] == result["generated_tokens"]
    assert invariant["router_choices"] > invariant["tokens"]  # prompt tokens are routed too
    assert fast["overhead_engine"] == fast["overhead_trainer"] == 1.0
    assert invariant["overhead_engine"] > 0 and invariant["overhead_trainer"] > 0
    assert result["engine_tokens_per_s"]["invariant"] > 0 and result["model"]["hidden_size"] == 32


def test_bad_arguments_are_refused():
    with pytest.raises(WhetstoneError, match="float16"):
        tiny_run(dtype="float16")
    with pytest.raises(WhetstoneError, match="rounds must be >= 1, got 0"):
        tiny_run(rounds=0)


def test_cli_prints_one_json_object(monkeypatch):
    real_run = consistency.run
    # The command's own options pass through; the workload is shrunk to the tiny model's.
    monkeypatch.setattr(
        consistency,
        "run",
        lambda **options: real_run(
            **options, requests=3, max_batch=2, prompt_tokens=16, new_tokens=6, train_steps=1, config=TINY
        ),
    )
    result = CliRunner().invoke(app, ["consistency", "--json", "--rounds", "1"])
    assert result.exit_code == 0, result.output
    figures = json.loads(result.output)
    assert figures["invariant"]["bitwise_equal_fraction"] == 1.0
    assert figures["rounds"] == 1 and figures["threads"] == 1 and figures["dtype"] == "float32"
