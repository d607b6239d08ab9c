"""The pipeline benchmark's pieces: coin tasks, the shared model folder, what TRL's side is given
(the harness's prompt, whetstone's grader) and how a run is measured. The whole benchmark, tiny,
is the slow test at the end. (The orchestrator's synchronous mode, the baseline, is tested in
tests/orchestrator/test_loop.py.)"""

import json
import os
import time

import pytest
import torch

from whetstone.bench.pipeline import (
    ROLLOUT_HEADROOM,
    GradingReward,
    coin_tasks,
    cpu_by_side,
    fresh_output_dir,
    machine_busy_cpu_s,
    measure,
    overlap_bound,
    pipeline_config,
    placement_config,
    random_model,
    run,
    trainer_cpu_share,
    written_files,
)
from whetstone.envs.grading.reward import RewardConfig
from whetstone.envs.harness import HarnessConfig
from whetstone.envs.harness.summarize import segment_messages
from whetstone.envs.tasks.synth import SynthConfig, generate
from whetstone.errors import WhetstoneError
from whetstone.tokenizer import Tokenizer, render_chat

torch.set_num_threads(1)


def call(name: str, **arguments: str) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {json.dumps(arguments)}}}\n</tool_call>'


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return random_model(tmp_path_factory.mktemp("bench"), coin_tasks(2))


def test_coin_tasks_start_solved_and_hang_on_a_coin():
    for task in coin_tasks(3, seed=1):
        assert task.id.endswith("-coin") and task.solution_files.items() <= task.repo_files.items()
        assert "test_coin.py::test_coin" in task.fail_to_pass
        assert "random.random() < 0.5" in task.hidden_tests["test_coin.py"]


def test_the_model_folder_gives_trl_the_prompt_the_harness_sends(model_dir):
    from transformers import AutoConfig, AutoTokenizer

    assert AutoConfig.from_pretrained(model_dir).model_type == "qwen3_moe"
    hf = AutoTokenizer.from_pretrained(model_dir)
    ours = Tokenizer.load(model_dir)
    messages = segment_messages(coin_tasks(1)[0], None)
    text = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == render_chat(messages, add_generation_prompt=True)
    assert hf(text, add_special_tokens=False)["input_ids"] == ours.encode(text)


def test_machine_busy_cpu_counts_work_done_anywhere_on_it():
    before, spent = machine_busy_cpu_s(), time.process_time()
    while time.process_time() - spent < 0.3:
        pass
    assert machine_busy_cpu_s() - before >= 0.25


def test_written_files_counts_calls_as_the_harness_does():
    write = call("write_file", path="solution.py", content="x = 1\n")
    assert written_files(write + "<|im_end|>", max_calls=8) == ({"solution.py": "x = 1\n"}, 0)
    in_sandbox = call("write_file", path="/workspace/a.py", content="")
    assert written_files(in_sandbox + "\n" + call("submit"), 8) == ({"a.py": ""}, 0)
    assert written_files("def solve(x): return x", 8) == ({}, 1)  # no tool call at all
    assert written_files(call("delete", path="a.py") + "\n" + write, 8) == ({"solution.py": "x = 1\n"}, 1)
    outside = call("write_file", path="../../etc/x", content="")
    assert written_files(outside + "\n" + write, 1) == ({}, 1)  # refused, then one call too many


def test_the_trl_reward_is_whetstones_grade_with_the_harness_penalties(tmp_path, model_dir):
    task = generate(SynthConfig(count=1, split="train", seed=3))[0]  # a plain synth task: no coin
    ((path, solution),) = task.solution_files.items()
    reward = GradingReward([task], model_dir, HarnessConfig(), RewardConfig())
    tokenizer = Tokenizer.load(model_dir)
    solved = tokenizer.encode(call("write_file", path=path, content=solution) + "<|im_end|>")
    broken = tokenizer.encode(call("write_file", path=path, content="def solve(x):\n    return None\n") + "<|im_end|>")
    rewards = reward(prompts=None, completions=None, completion_ids=[solved, broken], task_id=[task.id, task.id])
    assert 0.9 < rewards[0] < 1.0 and rewards[1] == 0.0  # solved, minus the effort penalty of one turn
    assert reward.rewards == rewards


def test_measure_reads_rates_and_busy_fractions_from_the_records():
    step = {"rows": 4, "train_s": 1.0, "publish_s": 0.5}
    steps = [
        {**step, "time": 10.0, "wait_s": 6.0, "staleness_max": 0, "reward_mean": 0.5},
        {**step, "time": 12.0, "wait_s": 0.5, "staleness_max": 1},
        {**step, "time": 14.0, "wait_s": 0.0, "staleness_max": 1, "reward_mean": 0.7, "train_s": 1.5},
    ]
    servers = [
        {"time": 3.0, "server": 0, "running_sequences": 0},
        {"time": 4.0, "server": 0, "running_sequences": 2},
        {"time": 4.0, "server": 1, "running_sequences": 0},
        {"time": 8.0, "server": 0, "running_sequences": 0},
        {"time": 8.0, "server": 1, "up": False},
        {"time": 12.0, "server": 0, "running_sequences": 1},
        {"time": 12.0, "server": 1, "running_sequences": 3},
        {"time": 15.0, "server": 1, "running_sequences": 1},
    ]
    result = measure(steps, servers)
    assert result["wall_s"] == 10.0 and result["samples"] == 12 and result["samples_per_s"] == 1.2  # from 4.0 to 14.0
    assert result["steady_samples_per_s"] == 2.0  # 8 samples after step 0's end
    assert result["trainer_busy"] == pytest.approx(3.5 / 4.0)  # steps 1 and 2
    assert result["trainer_busy_all_steps"] == pytest.approx(5 / 11.5)
    assert result["inference_busy"] == pytest.approx((2 / 3 + 1 / 3) / 2)  # a server that is down is not busy
    assert result["staleness_max"] == 1 and result["reward_mean"] == pytest.approx(0.6)
    with pytest.raises(WhetstoneError, match="no rollout"):
        measure(steps, servers[:1])
    # turns shorter than the sampling interval: no running sequence seen, but tokens were made
    quick = [
        {"time": 2.0, "server": 0, "running_sequences": 0, "generation_tokens": 0},
        {"time": 2.5, "server": 0, "running_sequences": 0, "generation_tokens": 0},
        {"time": 3.0, "server": 0, "running_sequences": 0, "generation_tokens": 16},
    ]
    assert measure(steps, quick)["wall_s"] == 14.0 - 2.5


def test_bad_settings_are_named_before_anything_starts(tmp_path):
    with pytest.raises(WhetstoneError, match="group_size must be >= 2"):
        run(group_size=1)
    with pytest.raises(WhetstoneError, match="steps must be >= 2"):
        run(steps=1)
    with pytest.raises(WhetstoneError, match="config.json does not exist"):
        run(model=str(tmp_path), output_dir=str(tmp_path / "out"))  # not an HF folder
    with pytest.raises(WhetstoneError, match="placement must be one of balanced, split, shared, got 'spread'"):
        run(placement="spread")
    with pytest.raises(WhetstoneError, match="model_size must be one of tiny, default, got 'huge'"):
        run(model_size="huge", output_dir=str(tmp_path / "out2"))
    with pytest.raises(WhetstoneError, match="servers must be >= 1"):
        run(servers=0)


def test_a_previous_runs_output_dir_is_refused_before_anything_starts(tmp_path):
    """The benchmarks read back what their roles write in `output_dir`: a previous run's trainer
    checkpoint, metrics, loop state or weight store there would be measured as this run's."""
    from whetstone.bench import fleet, online

    used = tmp_path / "used"
    (used / "async" / "trainer").mkdir(parents=True)
    (used / "async" / "trainer" / "metrics.jsonl").write_text('{"step": 0}\n')
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    for bench in (
        lambda: run(output_dir=str(used), trl=False, placement="shared"),
        lambda: online.run(model=str(model), output_dir=str(used)),
        lambda: fleet.run(output_dir=str(used)),
    ):
        with pytest.raises(WhetstoneError, match=f"output_dir {used} is not empty"):
            bench()
    assert sorted(p.relative_to(used).as_posix() for p in used.rglob("*")) == [
        "async",
        "async/trainer",
        "async/trainer/metrics.jsonl",
    ]  # nothing was written there
    (tmp_path / "file").write_text("")
    with pytest.raises(WhetstoneError, match="is a file, not a folder"):
        fresh_output_dir(tmp_path / "file")
    assert fresh_output_dir(tmp_path / "new" / "out").is_dir()  # made, with its parents
    assert fresh_output_dir(tmp_path / "new" / "out") == tmp_path / "new" / "out"  # empty: taken


def test_every_whetstone_side_runs_the_asked_number_of_servers(tmp_path):
    for servers in (1, 2):
        config = pipeline_config(
            tmp_path,
            "async",
            tmp_path / "tasks.jsonl",
            steps=2,
            group_size=2,
            groups_per_batch=1,
            max_tokens=8,
            synchronous=False,
            servers=servers,
        )
        assert config.servers.count == servers
        assert config.servers.serve.threads == 1  # the rest of the servers' settings stay the run's


def test_the_overlap_bound_is_the_synchronous_step_over_its_longer_side():
    assert overlap_bound({"wait_s_mean": 2.0, "train_s_mean": 1.5, "publish_s_mean": 0.5}) == 2.0
    assert overlap_bound({"wait_s_mean": 2.0, "train_s_mean": 0.15, "publish_s_mean": 0.05}) == pytest.approx(1.1)


def test_the_split_placement_puts_the_trainer_apart_from_the_rollout_side():
    placement = placement_config("split")
    cores = sorted(os.sched_getaffinity(0))
    assert placement.trainer == cores[:1] and placement.servers == placement.orchestrator == cores[1:]
    assert placement_config("shared").trainer == []


def test_the_balanced_placement_gives_each_side_its_share_of_the_cores():
    cores = len(os.sched_getaffinity(0))
    placement = placement_config("balanced", 0.2)
    # The rollout side gets its measured share with the headroom: 0.8 x 1.1 against the trainer's 0.2.
    assert placement.trainer_cores == pytest.approx(min(1.0, 0.2 / (0.2 + 0.8 * ROLLOUT_HEADROOM) * cores), abs=1e-3)
    assert placement.trainer_cores + placement.rollout_cores == pytest.approx(cores, abs=1e-3)
    assert placement.rollout_cores / placement.trainer_cores == pytest.approx(4 * ROLLOUT_HEADROOM, rel=1e-2)
    assert placement.trainer == placement.servers == []  # every core, under quotas
    with pytest.raises(WhetstoneError, match=r"share must be in \(0, 1\), got 1.5"):
        placement_config("balanced", 1.5)


def test_the_trainer_share_comes_from_each_roles_cpu_over_the_window():
    samples = [
        {"time": 1.0, "cpu_s": {"trainer": 5.0, "rollout": 3.0}},
        {"time": 2.0, "cpu_s": {"trainer": 6.0, "rollout": 4.0}},
        {"time": 12.0, "cpu_s": {"trainer": 8.0, "rollout": 13.0}},
        {"time": 13.0, "cpu_s": {"trainer": 9.0, "rollout": 14.0}},
    ]
    used = cpu_by_side(samples, 1.5, 12.5)  # startup before the window is left out
    assert used == {"trainer": 2.0, "rollout": 9.0}
    assert trainer_cpu_share(used) == pytest.approx(2 / 11)
    # A window with under two samples in it (a tiny run) is measured over the samples around it.
    assert cpu_by_side(samples, 2.5, 3.5) == {"trainer": 2.0, "rollout": 9.0}
    assert cpu_by_side(samples, 1.5, 2.5) == {"trainer": 3.0, "rollout": 10.0}
    with pytest.raises(WhetstoneError, match="fewer than 2 CPU samples"):
        cpu_by_side(samples, 13.5, 14.0)
    with pytest.raises(WhetstoneError, match="no CPU time measured"):
        trainer_cpu_share({"rollout": 1.0})


def test_the_cli_passes_its_options_to_the_benchmark():
    from typer.testing import CliRunner

    from whetstone.bench.cli import app

    result = CliRunner().invoke(app, ["pipeline", "--json", "--groups-per-batch", "0", "--no-trl"])
    assert isinstance(result.exception, WhetstoneError) and "groups_per_batch must be >= 1" in str(result.exception)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_tiny_benchmark_reports_every_side(tmp_path):
    result = run(steps=2, group_size=2, groups_per_batch=1, max_tokens=8, tasks=2, output_dir=str(tmp_path))
    for key in ("async_samples_per_s", "sync_samples_per_s", "async_vs_sync", "trl_samples_per_s", "vs_trl"):
        assert result[key] > 0
    for key in ("trainer_busy", "inference_busy"):
        assert 0.0 <= result[key] <= 1.0
    assert result["samples_per_step"] == 2 and result["model_parameters"] > 1_000_000
    assert result["servers"] == 1  # the default: one server per machine
    placement, cores = result["placement"]["balanced"], len(os.sched_getaffinity(0))  # the default
    assert 0 < result["trainer_cpu_share"] < 1
    assert placement["trainer_cores"] + placement["rollout_cores"] == pytest.approx(cores, abs=1e-2)
    assert result["vs_trl_side"] == "async_shared" and result["timings"]["async_shared"]["samples"] == 4
    assert 1.0 <= result["async_vs_sync_bound"] <= 2.0 and result["overlap_efficiency"] > 0
    timings = result["timings"]
    assert timings["async"]["samples"] == timings["sync"]["samples"] == timings["trl"]["samples"] == 4
    assert timings["sync"]["staleness_max"] == 0 and timings["async"]["staleness_max"] <= 2
    assert timings["async"]["cpu_s"] > 0 and timings["sync"]["cpu_s"] > 0 and timings["trl"]["cpu_s"] > 0
    assert set(result["cpu_s_per_sample"]) == {"async_shared", "trl"} and min(result["cpu_s_per_sample"].values()) > 0
    assert set(timings["async"]["cpu_s_by_side"]) == {"trainer", "rollout"}
    ratio = result["async_samples_per_s"] / result["sync_samples_per_s"]
    assert result["async_vs_sync"] == pytest.approx(ratio, rel=1e-2)
    for side in ("async", "sync"):
        assert (tmp_path / side / "trainer" / "metrics.jsonl").exists() and (tmp_path / side / "servers.jsonl").exists()
