"""The evaluation report from known trajectories, and `whetstone eval`'s answers to bad input."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from whetstone.envs.eval import build_report, render_markdown, solved
from whetstone.envs.eval.cli import app
from whetstone.envs.harness import PolicyError
from whetstone.envs.trajectory import ModelCall, Segment, Trajectory
from whetstone.errors import ConfigError


def rollout(task_id, reward=0.0, tests=0.0, flags=(), status="ok", turns=2, tokens=10):
    call = ModelCall(
        prompt_ids=[1],
        completion_ids=[2] * tokens,
        logprobs=[-1.0] * tokens,
        versions=[0] * tokens,
        loss_mask=[1] * tokens,
    )
    return Trajectory(
        task_id=task_id,
        segments=[Segment(calls=[call])],
        reward=reward,
        turns=turns,
        cheat_flags=list(flags),
        solved=tests == 1.0 and status == "ok",
        reward_breakdown={"tests": tests, "effort_penalty": -0.02} if status == "ok" else {},
        status=status,
        error=None if status == "ok" else "PolicyError: HTTP 503",
        timings={"total": 2.0},
    )


RUN = {"model": "m", "endpoint": "http://x/v1", "wall_clock_s": 1.0}
TRAJECTORIES = [
    rollout("a", reward=0.98, tests=1.0),
    rollout("a", reward=0.98, tests=1.0),
    rollout("a"),
    rollout("b", reward=0.98, tests=1.0),
    rollout("b", flags=["conftest: conftest.py"]),
    rollout("b", status="failed"),
]


def test_solved_means_ran_unflagged_and_every_required_test_passed():
    assert [solved(t) for t in TRAJECTORIES] == [True, True, False, True, False, False]
    assert not solved(rollout("c", tests=0.5))  # partial credit is not a solve
    # The trajectory's own `solved` (every test passed) is not enough: a cheat flag or a
    # failed rollout is not a solve even when it is set.
    flagged = rollout("c", tests=1.0, flags=["conftest: conftest.py"])
    failed = rollout("c", status="failed").model_copy(update={"solved": True})
    assert flagged.solved and failed.solved
    assert not solved(flagged) and not solved(failed)


def test_report_numbers():
    report = build_report(TRAJECTORIES, [1, 3], RUN)
    assert (report["tasks"], report["rollouts"], report["solved_rollouts"], report["failed_rollouts"]) == (2, 6, 3, 1)
    assert report["pass_at_k"] == {"1": pytest.approx((2 / 3 + 1 / 3) / 2), "3": 1.0}
    assert report["per_task"][0] == {
        "task_id": "a",
        "samples": 3,
        "solved": 2,
        "mean_reward": pytest.approx(0.98 * 2 / 3),
        "pass_at_k": {"1": pytest.approx(2 / 3), "3": 1.0},
    }
    assert report["cheat_flags"] == {"conftest": 1} and report["flagged_rollouts"] == 1
    assert report["failures"] == [{"task_id": "b", "error": "PolicyError: HTTP 503"}]
    assert report["turns"] == {"mean": 2.0, "p50": 2.0, "max": 2}  # over the rollouts that ran
    assert report["reward"]["breakdown"] == {"effort_penalty": pytest.approx(-0.02), "tests": pytest.approx(0.6)}


def test_markdown_shows_the_headline_and_every_task():
    text = render_markdown(build_report(TRAJECTORIES, [1, 3], RUN))
    assert text.startswith("# Evaluation of `m`\n\n2 tasks, 6 rollouts (3 solved, 1 failed)")
    assert "| pass@1 | 0.500 |" in text and "| pass@3 | 1.000 |" in text
    assert "| `a` | 2/3 | 0.653 | 0.667 | 1.000 |" in text and "| conftest | 1 |" in text
    assert "- `b`: PolicyError: HTTP 503" in text


def test_a_task_id_or_error_that_would_break_the_markdown_stays_in_its_cell_and_line():
    odd = rollout("x|`y`", status="error")
    odd.error = "Traceback:\n  line 1\nValueError"
    text = render_markdown(build_report([odd, rollout("a", reward=0.98, tests=1.0)], [1], RUN))
    assert "| `` x\\|`y` `` | 0/1 | 0.000 | 0.000 |" in text  # the | escaped, the backticks fenced
    assert "- `` x|`y` ``: Traceback: line 1 ValueError" in text


def test_bad_config_and_unreachable_endpoint_are_named(tmp_path):
    runner = CliRunner()
    result = runner.invoke(app, ["eval", "--set", "samples=2", "--set", "k=[1, 4]"])
    assert isinstance(result.exception, ConfigError)
    assert "each k must be between 1 and samples=2" in str(result.exception)
    base = ["eval", "-s", "validate_tasks=false", "-s", "tasks.synth.count=1", "-s", f"output_dir={tmp_path}"]
    result = runner.invoke(app, base)
    assert isinstance(result.exception, ConfigError) and "harness.tokenizer_path is not set" in str(result.exception)
    (tmp_path / "tok").mkdir()
    from tests.envs.harness.harness_support import tokenizer

    tokenizer().save(tmp_path / "tok")
    result = runner.invoke(
        app,
        [
            *base,
            "-s",
            f"harness.tokenizer_path={tmp_path / 'tok'}",
            "-s",
            "endpoint.base_url=http://127.0.0.1:9/v1",
            "-s",
            "endpoint.retries=0",
        ],
    )
    assert isinstance(result.exception, PolicyError) and "127.0.0.1:9" in str(result.exception)
    assert not (tmp_path / "report.json").exists()


ALL_FAILED = [rollout("a", status="failed"), rollout("b", status="failed")]
NOT_MEASURED = {"mean": None, "p50": None, "max": None}


def test_effort_is_not_measured_when_no_rollout_ran():
    # A failed rollout has no turns or tokens to count: zeros would read as a model that answers
    # in no turns, so the figures are absent, and the report says so.
    report = build_report(ALL_FAILED, [1], RUN)
    for name in ("turns", "completion_tokens", "segments", "invalid_tool_calls"):
        assert report[name] == NOT_MEASURED
    assert report["reward"]["mean"] == 0.0  # the failed rollouts' own reward: it is measured
    assert build_report([], [1], RUN)["reward"] == {**NOT_MEASURED, "breakdown": {}}
    text = render_markdown(report)
    assert "| turns (mean / p50 / max) | not measured (no rollout ran) |" in text
    assert "| completion_tokens (mean / p50 / max) | not measured (no rollout ran) |" in text
    assert "| reward (mean / p50 / max) | 0.000 / 0.000 / 0.000 |" in text


def test_eval_summary_line_says_when_turns_were_not_measured(monkeypatch):
    import whetstone.envs.eval.run as run

    monkeypatch.setattr(run, "load_eval_tasks", lambda settings: [])
    monkeypatch.setattr(run, "evaluate_with_progress", lambda settings, tasks: build_report(ALL_FAILED, [1], RUN))
    result = CliRunner().invoke(app, ["eval"])
    assert result.exit_code == 0, result.output
    assert "m: pass@1 0.000  reward 0.000  turns not measured  failed 2/2" in result.output


def test_cheat_flags_count_each_rollout_once_per_kind():
    # Two conftest.py files in one rollout are one rollout flagged for conftest, not two.
    twice = rollout("a", flags=["conftest: conftest.py", "conftest: tests/conftest.py", "test_skip: t.py uses skip"])
    report = build_report([twice, rollout("a", flags=["conftest: conftest.py"]), rollout("b")], [1], RUN)
    assert report["cheat_flags"] == {"conftest": 2, "test_skip": 1} and report["flagged_rollouts"] == 2
    assert "| conftest | 2 |" in render_markdown(report)
