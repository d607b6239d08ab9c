"""The embedded default, whole command on a cold corpus cache: the issue's 5-minute promise.

Slow (minutes, both cores): run with `python -m pytest tests/midtrain -m slow`.
"""

import json
import time

import pytest
from typer.testing import CliRunner

from whetstone.midtrain.cli import app
from whetstone.utils.metrics import read_metrics


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_embedded_default_finishes_in_five_minutes_far_below_the_unigram_entropy(tmp_path):
    started = time.perf_counter()
    result = CliRunner().invoke(
        app,
        [
            "midtrain",
            "--json",
            "--set",
            f'data.cache_dir="{tmp_path / "cache"}"',
            "--set",
            f'run.output_dir="{tmp_path / "runs"}"',
        ],
    )
    elapsed = time.perf_counter() - started
    assert result.exit_code == 0, result.output
    summary = json.loads(result.output.strip().splitlines()[-1])
    print(
        f"whole command {elapsed:.0f} s, step {summary['step']} of {summary['steps']}, val loss "
        f"{summary['val_loss']:.3f}, unigram entropy {summary['unigram_entropy']:.3f}, "
        f"{summary['tokens_per_s']:.0f} tokens/s"
    )
    # On a busy machine run.max_wall_time ends training early (stopped_early): still in time.
    assert summary["finished"] or summary["stopped_early"]
    assert elapsed < 300
    assert summary["val_loss"] < summary["unigram_entropy"] - 1.5
    losses = [r["val_loss"] for r in read_metrics(tmp_path / "runs" / "midtrain" / "metrics.jsonl") if "val_loss" in r]
    assert losses[-1] == min(losses)
