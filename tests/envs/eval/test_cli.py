"""`whetstone eval` end to end against the real inference server (engine + HTTP app, in a thread
of this process): a tiny MoE with random weights, so pass@1 is ~0 and the pipeline is what is
checked; rollouts over HTTP, grading, and a report whose numbers follow from the trajectories.
test_eval_serve.py runs the same check against a separate `whetstone serve` process (slow)."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from tests.envs.harness.harness_support import save_tiny_model, serve_in_thread
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
    result = CliRunner().invoke(
        app, ["eval", str(config), "--json", "-s", "validate_tasks=false", "-s", "tasks.synth.count=1"]
    )
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout) == json.loads((out / "report.json").read_text())  # the bar is on stderr
    assert not (out / "trajectories.jsonl").exists()


def completions(out) -> list[list[list[int]]]:
    return [[call.completion_ids for call in t.calls] for t in load_trajectories(out / "trajectories.jsonl")]


def test_seeded_evaluations_draw_the_same_random_numbers_and_unseeded_ones_do_not(server, model_dir, tmp_path):
    """Paired evaluation: two runs with the same seed sample the same tokens from the same weights
    (so before/after RL differ only where the policy did); a task's samples still differ."""
    runs = {}
    for name, seed in (("a", 0), ("b", 0), ("c", 5), ("d", -1), ("e", -1)):
        out = tmp_path / name
        config = write_config(tmp_path / f"{name}.toml", server, model_dir, out)
        result = CliRunner().invoke(app, ["eval", str(config), "-s", "validate_tasks=false", "-s", f"seed={seed}"])
        assert result.exit_code == 0, result.output
        runs[name] = completions(out)
    assert runs["a"] == runs["b"]  # same seed, same weights: the same tokens, call for call
    assert runs["a"] != runs["c"] and runs["d"] != runs["e"]  # another seed, or none (-1): other draws
    assert runs["a"][0] != runs["a"][1]  # the two samples of a task use different seeds


def test_a_seeded_policy_gives_each_call_of_a_rollout_its_own_seed():
    import asyncio

    from tests.envs.harness.harness_support import ScriptedPolicy
    from whetstone.envs.harness.policy import Sampling, SeededPolicy
    from whetstone.envs.harness.rollout import rollout_seed

    seen = []

    class Recording(ScriptedPolicy):
        async def complete(self, prompt_ids, sampling):
            seen.append(sampling.seed)
            return await super().complete(prompt_ids, sampling)

    policy = SeededPolicy(Recording(lambda prompt: "hi"), rollout_seed(0, "task/1", 0))
    for _ in range(3):
        asyncio.run(policy.complete([1, 2], Sampling(max_tokens=4)))
    first = rollout_seed(0, "task/1", 0)
    assert seen == [first, first + 1, first + 2] and 0 <= first < 2**62
    assert (
        len(
            {
                rollout_seed(0, "task/1", 0),
                rollout_seed(0, "task/1", 1),
                rollout_seed(0, "task/2", 0),
                rollout_seed(1, "task/1", 0),
            }
        )
        == 4
    )


def test_a_temperature_sweep_samples_each_temperature_on_the_headlines_seeds(server, model_dir, tmp_path):
    """Each temperature of a sweep is the evaluation at that temperature on the same seeds (its
    tokens equal a run at that temperature alone), while the headline figures stay the harness's."""
    sweep, alone = tmp_path / "sweep", tmp_path / "alone"
    config = write_config(tmp_path / "sweep.toml", server, model_dir, sweep, temperatures=[0.5, 1.0])
    result = CliRunner().invoke(app, ["eval", str(config), "-s", "validate_tasks=false"])
    assert result.exit_code == 0, result.output
    config = write_config(tmp_path / "alone.toml", server, model_dir, alone)
    result = CliRunner().invoke(
        app, ["eval", str(config), "-s", "validate_tasks=false", "-s", "harness.sampling.temperature=0.5"]
    )
    assert result.exit_code == 0, result.output

    report = json.loads((sweep / "report.json").read_text())
    assert [p["temperature"] for p in report["temperatures"]] == [1.0, 0.5] and report["rollouts"] == 4
    trajectories = load_trajectories(sweep / "trajectories.jsonl")
    headline = [t for t in trajectories if t.group_id == t.task_id]
    swept = [t for t in trajectories if t.group_id == f"T=0.5/{t.task_id}"]
    assert len(headline) == len(swept) == 4
    tokens = [[call.completion_ids for call in t.calls] for t in swept]
    assert tokens == completions(alone)  # the same draws as the evaluation at 0.5 alone
    assert tokens != [[call.completion_ids for call in t.calls] for t in headline]
    for point, group in zip(report["temperatures"], (headline, swept)):
        counts = {t.task_id: (2, sum(solved(x) for x in group if x.task_id == t.task_id)) for t in group}
        assert point["rollouts"] == 4 and point["pass_at_k"]["1"] == mean_pass_at_k(list(counts.values()), 1)
        assert {row["task_id"]: (row["samples"], row["solved"]) for row in point["per_task"]} == counts
    assert report["temperatures"][0]["pass_at_k"] == report["pass_at_k"]
    assert "## By sampling temperature (same tasks, same seeds)" in (sweep / "report.md").read_text()


def test_an_output_dir_that_cannot_be_written_is_named_before_any_rollout(server, model_dir, tmp_path):
    from whetstone.config import load_config
    from whetstone.envs.eval.config import EvalConfig
    from whetstone.envs.eval.run import evaluate, load_eval_tasks
    from whetstone.errors import WhetstoneError

    (tmp_path / "a-file").write_text("not a folder")
    config = write_config(tmp_path / "eval.toml", server, model_dir, tmp_path / "a-file" / "eval")
    result = CliRunner().invoke(app, ["eval", str(config), "-s", "validate_tasks=false"])
    assert isinstance(result.exception, WhetstoneError), result.exception
    assert f"output_dir: {tmp_path / 'a-file' / 'eval'} cannot be created: {tmp_path / 'a-file'} is a file" in str(
        result.exception
    )
    settings = load_config(EvalConfig, config, ["validate_tasks=false"])
    done = []
    with pytest.raises(WhetstoneError, match="output_dir: "):
        evaluate(settings, load_eval_tasks(settings), done.append)
    assert done == []  # not one rollout ran

    # A report that cannot be written after the rollouts is an error naming the file, not a traceback.
    out = tmp_path / "eval"
    (out / "report.json" / "in-the-way").mkdir(parents=True)
    config = write_config(tmp_path / "eval.toml", server, model_dir, out, samples=1, k=[1])
    result = CliRunner().invoke(app, ["eval", str(config), "-s", "validate_tasks=false", "-s", "tasks.synth.count=1"])
    assert isinstance(result.exception, WhetstoneError), result.exception
    assert f"cannot write {out / 'report.json'}: Is a directory" in str(result.exception)
