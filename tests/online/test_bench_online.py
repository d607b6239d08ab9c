"""`whetstone bench online` end to end at tiny scale: two server processes, the loop process,
simulated users, on the two-style model (a process of its own: the bench renices itself)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.online.online_fixtures import PREFERS_CODE
from whetstone.bench.online import paired_change, store_clock_offset, summarize
from whetstone.online.simulator import Exchange


def exchanges(liked: str, seeds=None) -> list[Exchange]:
    """One exchange per character: task i, seed i (or seeds[i]), liked where the character is '1'."""
    return [
        Exchange(f"t{i}", f"r{i}", flag == "1", 0.1, seed=i if seeds is None else seeds[i])
        for i, flag in enumerate(liked)
    ]


def test_the_paired_change_counts_each_request_against_itself():
    before, after = exchanges("1100110000"), exchanges("1011111110")
    change = paired_change(before, after)
    assert change == {
        "pairs": 10,
        "both": 3,
        "neither": 1,
        "gained": 5,
        "lost": 1,
        "sign_test_p": pytest.approx(2 * (6 + 1) / 64),
    }  # P(>= 5 of 6) both ways
    # requests pair by (task, seed), whatever order the users' threads finished in
    assert paired_change(before[::-1], after) == change
    assert paired_change(before, exchanges("1011111110", seeds=list(range(10, 20))))["pairs"] == 0
    unchanged = paired_change(before, before)
    assert unchanged["gained"] == unchanged["lost"] == 0 and unchanged["sign_test_p"] == 1.0


def test_feedback_to_deployed_reads_the_database_clock_on_this_machine_s(tmp_path, monkeypatch):
    """The loop's `last_rated_at` is the feedback store's clock (a PostgreSQL host's), the
    servers' samples this machine's: one 1000 s ahead must not make 5 s read as -995 s."""
    import time

    from whetstone.store.feedback import FeedbackStore

    real_now = FeedbackStore.now
    monkeypatch.setattr(FeedbackStore, "now", lambda store: real_now(store) + 1000.0)
    offset = store_clock_offset(str(tmp_path / "feedback.db"))
    assert offset == pytest.approx(-1000.0, abs=1.0)
    rated = time.time()
    records = [{"decision": "published", "version": 1, "last_rated_at": rated + 1000.0, "reason": "better"}]
    samples = [{"server": 0, "up": True, "weight_version": 1, "time": rated + 5.0}]
    replies = exchanges("10")
    figures = summarize(records, samples, 1, replies, replies, replies, replies, offset)
    assert figures["feedback_to_deployed_s_each"] == [pytest.approx(5.0, abs=1.0)]


@pytest.mark.slow  # about a minute: three processes start and the loop updates twice
def test_the_benchmark_reports_its_figures(two_style_dir, tmp_path):
    command = [
        sys.executable,
        "-m",
        "whetstone.cli",
        "bench",
        "online",
        "--json",
        "--model",
        str(two_style_dir),
        "--preference",
        PREFERS_CODE,
        "--max-tokens",
        "12",
        "--updates",
        "2",
        "--every-events",
        "8",
        "--heldout",
        "8",
        "--samples",
        "1",
        "--gate-tasks",
        "8",
        "--lr",
        "3e-3",
        "--output-dir",
        str(tmp_path),
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout)
    assert result["updates"] == 2 == result["published"] + result["discarded"] + result["skipped"]
    assert len(result["feedback_to_deployed_s_each"]) == result["published"]
    assert all(0 < seconds < 120 for seconds in result["feedback_to_deployed_s_each"])
    assert 0 <= result["preference_rate_before"] <= 1 and 0 <= result["preference_rate_after"] <= 1
    change = result["preference_change"]
    assert change["pairs"] == 8  # every held-out request was asked before and after with one seed
    assert result["samples_per_prompt"] == 1 and result["heldout_prompts"] == 8 and result["users"] == 2
    assert change["both"] + change["gained"] == round(result["preference_rate_after"] * 8)
    assert result["interactive_p99_ms"] > 0 and result["interactive_p99_idle_ms"] > 0


def test_counts_below_one_are_refused_before_anything_starts(tmp_path):
    """`updates = 0` is the loop's "until stopped": with users who never stop, the bench never would."""
    from whetstone.bench.online import run
    from whetstone.errors import WhetstoneError

    with pytest.raises(WhetstoneError, match="bench online: updates = 0, users = 0: each must be 1 or more"):
        run(model=str(tmp_path), updates=0, users=0, output_dir=str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()
