"""`whetstone eval` end to end against the real inference server (engine + HTTP app, in a thread
of this process): a tiny MoE with random weights, so pass@1 is ~0 and the pipeline is what is
checked; rollouts over HTTP, grading, and a report whose numbers follow from the trajectories.
test_eval_serve.py runs the same check against a separate `whetstone serve` process (slow)."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from tests.envs.test_harness_support import save_tiny_model, serve_in_thread
from whetstone.envs.eval import mean_pass_at_k, solved
from whetstone.envs.eval.cli import app
from whetstone.envs.trajectory import load_trajectories


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("model"))


@pytest.fixture(scope="module")
def server(model_dir):
    with serve_in_thread(model_dir) as url:
        yield url


def write_config(path, server, model_dir, out, **extra):
    fields = {"samples": 2, "k": [1, 2], "output_dir": str(out)} | extra
    top = "\n".join(f"{key} = {json.dumps(value)}" for key, value in fields.items())
    path.write_text(f"""{top}
[endpoint]
base_url = "{server}"
[harness]
tokenizer_path = "{model_dir}"
max_turns = 2
max_turn_tokens = 16
max_tool_tokens = 256
summary_tokens = 64
[rollout]
concurrency = 4
[tasks]
source = "synth"
[tasks.synth]
split = "heldout"
count = 2
""")
    return path


def check_eval(server, model_dir, tmp_path, *overrides):
    """Run `whetstone eval` with a progress bar and check its report against its trajectories."""
    out = tmp_path / "eval"
    config = write_config(tmp_path / "eval.toml", server, model_dir, out)
    result = CliRunner().invoke(app, ["eval", str(config), *overrides])
    assert result.exit_code == 0, result.output
    assert "tiny-agent: pass@1 " in result.output and f"report: {out / 'report.md'}" in result.output

    report = json.loads((out / "report.json").read_text())
    trajectories = load_trajectories(out / "trajectories.jsonl")
    assert report["model"] == "tiny-agent" and report["endpoint"] == server
    assert report["tasks"] == 2 and report["rollouts"] == len(trajectories) == 4 and report["failed_rollouts"] == 0
    for trajectory in trajectories:
        assert trajectory.task_id.startswith("synth/heldout/") and trajectory.status == "ok" and trajectory.turns == 2
        assert trajectory.group_id == trajectory.task_id and "grading" in trajectory.timings
        for call in trajectory.calls:
            assert call.versions == [0] * len(call.completion_ids) and call.routes is not None
    counts: dict[str, tuple[int, int]] = {}
    for trajectory in trajectories:
        n, c = counts.get(trajectory.task_id, (0, 0))
        counts[trajectory.task_id] = (n + 1, c + solved(trajectory))
    assert report["pass_at_k"] == {str(k): mean_pass_at_k(list(counts.values()), k) for k in (1, 2)}
    assert report["reward"]["mean"] == pytest.approx(sum(t.reward for t in trajectories) / 4)
    assert report["turns"]["mean"] == 2.0
    assert report["completion_tokens"]["mean"] == sum(t.completion_tokens for t in trajectories) / 4
    assert "# Evaluation of `tiny-agent`" in (out / "report.md").read_text()


def test_eval_writes_an_honest_report(server, model_dir, tmp_path):
    check_eval(server, model_dir, tmp_path, "-s", "validate_tasks=false")


def test_eval_json_prints_the_report(server, model_dir, tmp_path):
    out = tmp_path / "eval"
    config = write_config(tmp_path / "eval.toml", server, model_dir, out, samples=1, k=[1], save_trajectories=False)
    result = CliRunner().invoke(app, ["eval", str(config), "--json", "-s", "validate_tasks=false",
                                      "-s", "tasks.synth.count=1"])  # fmt: skip
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout) == json.loads((out / "report.json").read_text())  # the bar is on stderr
    assert not (out / "trajectories.jsonl").exists()
