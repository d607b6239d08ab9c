"""With stderr not a terminal (`whetstone run > log 2>&1`), every stage prints plain progress
lines at a steady pace instead of a bar that shows nothing until the stage ends. The RL stage
and both evaluations are checked in test_pipeline.py's whole run."""

import re

import pytest

from tests.run.run_support import tiny_run
from whetstone.run.pipeline import Pipeline
from whetstone.utils import progress


@pytest.fixture
def not_a_terminal(monkeypatch, capfd):
    """stderr is captured to a file by capfd: not a terminal, unless the environment forces one."""
    for name in ("FORCE_COLOR", "TTY_COMPATIBLE", "TTY_INTERACTIVE"):
        monkeypatch.delenv(name, raising=False)
    return capfd


def test_mid_training_prints_plain_lines_while_it_runs(tmp_path, monkeypatch, not_a_terminal):
    monkeypatch.setattr(
        progress, "PLAIN_INTERVAL_S", 0.001, raising=False
    )  # many lines within the few seconds it trains
    Pipeline(tiny_run(tmp_path)).midtrain()
    err = not_a_terminal.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("midtrain midtrain: ")]
    assert lines[0].startswith("midtrain midtrain: 0/1,024 tok (0%)")  # when the stage starts
    assert re.match(
        r"midtrain midtrain: 1,024/1,024 tok \(100%\)  [\d,.]+ tok/s  elapsed 0:\d\d  step=8  loss=", lines[-1]
    )
    assert len(lines) >= 3  # and in between, from the printing thread
    assert "\x1b[" not in err  # no terminal control codes in a log


def test_a_plain_line_shows_the_rate_the_eta_and_the_live_fields(not_a_terminal):
    with progress.progress_bar(16, "rl", "step") as bar:
        bar.update(4, reward=0.25, servers="3,4")
    first, *_, last = not_a_terminal.readouterr().err.splitlines()
    assert first == "rl: 0/16 step (0%)  elapsed 0:00"
    assert re.fullmatch(
        r"rl: 4/16 step \(25%\)  [\d,.]+ step/s  elapsed 0:\d\d  eta \d+:\d\d  reward=0\.25  servers=3,4", last
    )
    with progress.progress_bar(None, "train tokenizer", "run") as bar:  # no total: a count and the time
        bar.update(1)
    assert not_a_terminal.readouterr().err.splitlines()[-1].startswith("train tokenizer: 1 run  ")


def test_the_follower_of_mid_training_reads_records_appended_or_rewritten_since_it_looked(tmp_path):
    from whetstone.run.pipeline import _written_since
    from whetstone.utils.atomic import atomic_write_text

    metrics = tmp_path / "metrics.jsonl"
    assert not _written_since(metrics, None)  # nothing yet
    metrics.write_text('{"step": 5}\n{"step": 6}\n')
    assert _written_since(metrics, None)  # a fresh start: every record is this run's
    before = metrics.stat()
    assert not _written_since(metrics, before)  # a resumed run's file as it was: the stopped run's
    # the resumed role drops the records after its checkpoint (a new, shorter file), then writes on
    atomic_write_text(metrics, '{"step": 5}\n')
    assert _written_since(metrics, before)
