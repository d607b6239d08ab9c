"""The run report: one self-contained HTML page, whatever the run managed to write."""

import json
import os
import re
from collections import Counter

import pytest

from whetstone.errors import WhetstoneError
from whetstone.rl.staleness import StalenessHistogram
from whetstone.run.plots import _binned
from whetstone.run.report import (
    busy_fractions,
    cores_used,
    key_figures,
    load_run,
    swap_pauses,
    temperature_curves,
    trainer_busy_per_step,
    write_report,
)
from whetstone.utils.metrics import MetricsWriter

PLOT_SECTIONS = [
    "Reward",
    "Held-out pass@k",
    "Held-out pass@1 by sampling temperature",
    "Staleness",
    "Weight sync",
    "Trainer–rollout mismatch",
    "Busy fraction",
]


def write_jsonl(path, records, torn_tail=True):
    with MetricsWriter(path) as metrics:
        for record in records:
            metrics.write(record)
    if torn_tail:  # a process killed mid-write leaves half a line
        with path.open("a") as handle:
            handle.write('{"time": 1.0, "step": 99, "rew')


def trainer_step(step: int) -> dict:
    record = {
        "time": 1000.0 + step,
        "step": step,
        "replayed": False,
        "loss": 0.5 - 0.01 * step,
        "reward_mean": 0.2 + 0.1 * step,
        "mismatch_kl_k3": 1e-4 * (step + 1),
        "routing_disagreement": 0.02,
        "routing_disagreement_tokens": 0.3,
        "logprob_diff_mean": 0.01,
        "logprob_diff_p99": 0.1,
        "logprob_diff_max": 0.4,
        "clip_fraction": 0.01,
        "mask_fraction": 0.005,
        "tokens": 512,
        "entropy": 0.8 - 0.1 * step,
        "demo_nll": 0.01 + 0.001 * step,
        "staleness_histogram": StalenessHistogram(Counter({0: 6, 1: 2}), dropped=step % 2).metrics(),
        "version": step + 1,
        "delta_kind": "full" if step == 0 else "delta",
        "delta_bytes": 4_000_000 if step == 0 else 80_000,
        "delta_ratio": 1.0 if step == 0 else 50.0,
        "publish_s": 0.1,
        "train_s": 0.6,
        "wait_s": 0.3,
    }
    record["busy"] = 0.7
    return record


def server_samples() -> list[dict]:
    """Two servers sampled every 2 s; server 0 swaps at t=2 and t=6, server 1 at t=4; server 1 idles half the time."""
    samples = []
    for tick, t in enumerate([0.0, 2.0, 4.0, 6.0]):
        samples.append(
            {
                "time": t,
                "server": 0,
                "weight_version": [0, 1, 1, 2][tick],
                "running_sequences": 4,
                "swap_pause_last_s": [0.0, 0.002, 0.002, 0.004][tick],
                "swap_pause_count": [0, 1, 1, 2][tick],
                "tokens_per_second": 300.0,
            }
        )
        samples.append(
            {
                "time": t,
                "server": 1,
                "weight_version": [0, 0, 2, 2][tick],
                "running_sequences": tick % 2,
                "swap_pause_last_s": [0.0, 0.0, 0.003, 0.003][tick],
                "swap_pause_count": [0, 0, 1, 1][tick],
                "tokens_per_second": 250.0,
            }
        )
    return samples


def eval_report(pass1: float, pass4: float) -> dict:
    return {"tasks": 8, "rollouts": 32, "pass_at_k": {"1": pass1, "4": pass4}, "reward": {"mean": pass1}}


def sweep(before: dict[float, float], after: dict[float, float], scale: float) -> dict:
    """A summary's `temperature_sweep` (envs/eval/sweep.py) of these pass@1 curves."""

    def points(curve, divide):
        return [
            {"temperature": t, **({"effective_temperature": t / scale} if divide else {}), "pass1": p}
            for t, p in curve.items()
        ]

    return {
        "headline_temperature": 1.0,
        "logit_scale": scale,
        "temperatures": [1.0, 0.5, 0.2],
        "before": points(before, False),
        "after": points(after, True),
        "best_before": {"temperature": 0.2, "pass1": before[0.2]},
        "best_after": {"temperature": 0.5, "effective_temperature": 0.5 / scale, "pass1": after[0.5]},
        "gain_over_best_temperature": {"value": 0.0625, "se": 0.015, "tasks": 8},
        "gain_over_best_temperature_crossfit": {"value": 0.05, "se": 0.02, "tasks": 8},
        "scale_frozen_temperature": scale,
        "gain_scale_frozen": {"value": 0.125, "se": 0.04, "tasks": 8},
    }


@pytest.fixture(scope="module")
def full_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("runs") / "demo"
    (run_dir / "eval" / "before").mkdir(parents=True)
    (run_dir / "eval" / "after").mkdir(parents=True)
    summary = {
        "run_dir": str(run_dir),
        "wall_s": 312.0,
        "heldout_pass1_before": 0.125,
        "heldout_pass1_after": 0.375,
        "headline_temperature": 1.0,
        "final_logit_scale": 2.0,
        "gain_over_best_temperature": 0.0625,
        "gain_over_best_temperature_se": 0.015,
        "gain_scale_frozen": 0.125,
        "gain_scale_frozen_se": 0.04,
        "temperature_sweep": sweep(
            {1.0: 0.125, 0.5: 0.25, 0.2: 0.3125}, {2.0: 0.25, 1.0: 0.375, 0.5: 0.375, 0.2: 0.25}, 2.0
        ),
        "stages": {
            "midtrain": {"val_loss": 1.2},
            "rl": {"steps": 4, "steps_planned": 4, "stopped_at_wall_time": False},
        },
        "config": {"name": "demo", "rl": {"lr": 1e-6}},
    }
    (run_dir / "summary.json").write_text(json.dumps(summary))
    (run_dir / "eval" / "before" / "report.json").write_text(json.dumps(eval_report(0.125, 0.3)))
    (run_dir / "eval" / "after" / "report.json").write_text(json.dumps(eval_report(0.375, 0.6)))
    write_jsonl(run_dir / "trainer" / "metrics.jsonl", [trainer_step(step) for step in range(4)])
    batches = [
        {
            "index": i,
            "samples": 8,
            "rollouts": 8,
            "reward_mean": 0.2 + 0.1 * i,
            "staleness_0": 6,
            "groups.dropped_no_variance": 1,
            "servers_alive": 2,
            "calls_rerun": 0,
        }
        for i in range(4)
    ]
    write_jsonl(run_dir / "orchestrator" / "metrics.jsonl", batches)
    write_jsonl(run_dir / "servers.jsonl", server_samples())
    write_jsonl(
        run_dir / "cpu.jsonl",
        [
            {"time": 100.0, "cpu_s": {"trainer": 1.0, "rollout": 2.0}},
            {"time": 110.0, "cpu_s": {"trainer": 3.5, "rollout": 17.0}},
        ],
    )
    path = write_report(run_dir)
    return run_dir, path, path.read_text()


def test_a_full_run_gets_every_section_with_one_inline_plot_each(full_run):
    run_dir, path, page = full_run
    assert path == run_dir / "report.html"
    positions = [page.index(f"<h2>{title}</h2>") for title in [*PLOT_SECTIONS, "Key figures", "Config"]]
    assert positions == sorted(positions)  # in the documented order
    assert page.count("<img ") == len(PLOT_SECTIONS) == page.count("src='data:image/png;base64,")
    assert "not recorded" not in page
    assert not re.search(r"(src|href)=['\"]https?:", page)  # self-contained: nothing fetched


def test_the_headline_shows_pass1_before_and_after_and_the_gain(full_run):
    _, _, page = full_run
    assert "held-out pass@1 at temperature 1: 12.5% → 37.5% (+25.0 points)" in page
    assert "each at its best temperature: +6.2 ± 1.5 points (paired SE)" in page
    assert "<h1>whetstone run: demo</h1>" in page and "312 s" in page


def test_key_figures_hold_the_numbers_behind_the_plots(full_run):
    _, _, page = full_run

    def row(what, value):
        return f"<tr><td>{what}</td><td>{value}</td></tr>"

    assert row("final reward (mean over the last batch)", "0.500") in page
    assert row("RL steps made / planned", "4 / 4") in page and "RL made no step" not in page
    assert row("versions published (full)", "4 (1)") in page
    assert row("mean delta size (delta versions)", "78.1 KiB") in page
    assert row("mean delta ratio (delta versions)", "50.0x") in page
    assert row("swap pauses seen", "3") in page and row("swap pause p50 / max", "3 / 4 ms") in page
    assert row("trainer busy", "70.0%") in page and row("server 0 busy", "100.0%") in page
    assert row("server 1 busy", "50.0%") in page
    assert row("samples dropped as too stale", "2") in page
    assert row("CPU used while the roles ran, trainer / rollout side (cores)", "0.25 / 1.50") in page
    assert row("policy entropy, first / last step (nats per trained token)", "0.8 / 0.5") in page
    assert row("demonstration loss, first / last step (anchor; nats per trained token)", "0.01 / 0.013") in page
    assert "<details>" in page and "&quot;lr&quot;: 1e-06" in page


def test_key_figures_compare_each_model_at_its_best_temperature(full_run):
    _, _, page = full_run

    def row(what, value):
        return f"<tr><td>{what}</td><td>{value}</td></tr>"

    assert row("temperature of the held-out pass@1 above", "1") in page
    assert row("held-out pass@1 before RL at its best temperature", "0.312 at T = 0.2") in page
    assert row("held-out pass@1 after RL at its best temperature", "0.375 at T = 0.5 (effective 0.25)") in page
    assert row("gain over the best temperature (± paired SE)", "+6.2 ± 1.5 points") in page
    assert (
        row("the same, each half of the tasks at the temperatures best on the other half", "+5.0 ± 2.0 points") in page
    )
    frozen = "gain with the learned logit scale removed (after RL sampled at T = 2; ± paired SE)"
    assert row(frozen, "+12.5 ± 4.0 points") in page


def test_a_run_stopped_during_rl_plots_the_bases_temperature_curve_from_its_evaluation(tmp_path):
    (tmp_path / "eval" / "before").mkdir(parents=True)
    points = [{"temperature": t, "pass_at_k": {"1": p}} for t, p in ((1.0, 0.25), (0.5, 0.5), (0.2, 0.5))]
    (tmp_path / "eval" / "before" / "report.json").write_text(
        json.dumps({**eval_report(0.25, 0.5), "temperatures": points})
    )
    curves = temperature_curves(load_run(tmp_path))
    assert curves.before == {1.0: 0.25, 0.5: 0.5, 0.2: 0.5} and curves.after == {} and curves.logit_scale is None
    page = write_report(tmp_path).read_text()
    assert "<h2>Held-out pass@1 by sampling temperature</h2>\n<img " in page


def test_the_report_replaces_an_old_one_atomically(full_run, tmp_path):
    run_dir, path, page = full_run
    assert [p.name for p in run_dir.iterdir() if p.name.startswith(".")] == []  # no temporary left behind
    # A rewrite renames a new file over the old one: a reader that opened the old report still
    # reads all of it, never a truncated or half-written page.
    summary = {"wall_s": 5.0, "heldout_pass1_before": 0.5, "heldout_pass1_after": None, "config": {}}
    (tmp_path / "summary.json").write_text(json.dumps(summary))
    path = write_report(tmp_path)
    first = path.read_text()
    with path.open() as reader:
        summary["heldout_pass1_before"] = 0.25
        (tmp_path / "summary.json").write_text(json.dumps(summary))
        assert write_report(tmp_path) == path
        assert os.fstat(reader.fileno()).st_ino != path.stat().st_ino
        assert reader.read() == first and "held-out pass@1: 50.0%" in first
    assert "held-out pass@1: 25.0%" in path.read_text()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_a_run_with_only_a_summary_says_what_was_not_recorded(tmp_path):
    (tmp_path / "summary.json").write_text(
        json.dumps({"wall_s": 5.0, "heldout_pass1_before": 0.5, "heldout_pass1_after": None, "config": {}})
    )
    page = write_report(tmp_path).read_text()
    assert "held-out pass@1: 50.0% → not recorded" in page
    assert page.count("<img ") == 1  # pass@1 before, from the summary
    for title in ["Reward", "Staleness", "Weight sync", "Trainer–rollout mismatch", "Busy fraction"]:
        section = page.split(f"<h2>{title}</h2>")[1].split("<h2>")[0]
        assert "<p class='missing'>not recorded</p>" in section


def test_a_run_whose_rl_made_no_step_says_why_in_its_headline(tmp_path):
    reason = "the orchestrator put no batch in 150 s: no group it finished had reward variance"
    rl = {"steps": 0, "steps_planned": 28, "stopped_at_wall_time": True, "no_step_reason": reason}
    summary = {"heldout_pass1_before": 0.0, "heldout_pass1_after": None, "stages": {"rl": rl}, "config": {}}
    (tmp_path / "summary.json").write_text(json.dumps(summary))
    page = write_report(tmp_path).read_text()
    assert f"RL made no step, so the final policy is the mid-trained one: {reason}" in page
    assert "<tr><td>RL steps made / planned</td><td>0 / 28 (stopped at rl.max_wall_time)</td></tr>" in page


def test_an_earlier_runs_evaluation_after_rl_is_not_shown_for_a_run_that_made_none(tmp_path):
    (tmp_path / "eval" / "after").mkdir(parents=True)
    (tmp_path / "eval" / "after" / "report.json").write_text(json.dumps(eval_report(0.9, 0.95)))  # the last run's
    summary = {"heldout_pass1_before": 0.25, "heldout_pass1_after": None, "config": {}}
    (tmp_path / "summary.json").write_text(json.dumps(summary))
    page = write_report(tmp_path).read_text()
    assert "held-out pass@1: 25.0% → not recorded" in page and "90.0%" not in page


def test_a_run_whose_orchestrator_gave_up_says_so_in_its_headline(tmp_path):
    reason = "the last 80 groups gave nothing to train on (rollouts dropped: no_variance 640): stopped at …"
    rl = {"steps": 12, "steps_planned": 28, "stopped_at_wall_time": False, "orchestrator_stopped": reason}
    summary = {"heldout_pass1_before": 0.5, "heldout_pass1_after": 0.75, "stages": {"rl": rl}, "config": {}}
    (tmp_path / "summary.json").write_text(json.dumps(summary))
    page = write_report(tmp_path).read_text()
    assert f"RL ended at step 12 of 28: the orchestrator stopped ({reason})" in page
    assert f"<tr><td>RL steps made / planned</td><td>12 / 28 (the orchestrator stopped: {reason})</td></tr>" in page


def test_a_run_killed_before_its_summary_still_gets_a_report(tmp_path):
    (tmp_path / "config.toml").write_text('name = "killed"\n\n[servers.serve]\nauth_token = "tok-71d2"\n')
    write_jsonl(tmp_path / "trainer" / "metrics.jsonl", [{"step": 0, "reward_mean": 0.25, "loss": 0.7}])
    page = write_report(tmp_path).read_text()
    assert "did not finish (no summary.json)" in page and "wall time not recorded" in page
    assert "&quot;name&quot;: &quot;killed&quot;" in page  # the config it started with
    assert "&quot;auth_token&quot;: &quot;***&quot;" in page and "tok-71d2" not in page  # the page is for sharing
    assert "<h2>Reward</h2>\n<img " in page


def test_nan_null_and_garbage_values_are_skipped_not_fatal(tmp_path):
    bad = [
        {
            "step": 0,
            "reward_mean": float("nan"),
            "mismatch_kl_k3": None,
            "routing_disagreement": "x",
            "staleness_histogram": "oops",
            "version": 1,
            "delta_bytes": float("inf"),
            "train_s": None,
        },
        {
            "step": 1,
            "reward_mean": 0.5,
            "mismatch_kl_k3": float("nan"),
            "staleness_histogram": {"0": 3, "1": None},
            "train_s": 1.0,
            "wait_s": float("nan"),
            "busy": 0.9,
        },
        [1, 2, 3],
        "a string record",
    ]
    (tmp_path / "trainer").mkdir()
    (tmp_path / "trainer" / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in bad) + "\n")
    (tmp_path / "summary.json").write_text('["not", "an", "object"]')
    (tmp_path / "servers.jsonl").write_bytes(b"\xff\xfe not text")
    (tmp_path / "eval" / "after").mkdir(parents=True)
    (tmp_path / "eval" / "after" / "report.json").write_text('{"pass_at_k": {"1": NaN, "k": 0.5, "2": 0.25}}')
    page = write_report(tmp_path).read_text()
    assert "<h2>Reward</h2>\n<img " in page and "<h2>Staleness</h2>\n<img " in page
    assert "<h2>Trainer–rollout mismatch</h2>\n<p class='missing'>" in page
    assert "held-out pass@1: not recorded → not recorded" in page  # NaN is not a score
    assert "<h2>Held-out pass@k</h2>\n<img " in page  # pass@2 after is still shown


def test_a_missing_run_folder_is_an_error_naming_it(tmp_path):
    with pytest.raises(WhetstoneError, match="no run folder at .*nowhere"):
        write_report(tmp_path / "nowhere")


def test_a_page_that_cannot_be_written_is_an_error_naming_it(tmp_path):
    (tmp_path / "report.html" / "in-the-way").mkdir(parents=True)
    with pytest.raises(WhetstoneError, match=f"cannot write {tmp_path / 'report.html'}: Is a directory"):
        write_report(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.html"]  # no temporary left behind


def test_swap_pauses_come_from_rises_of_the_swap_count():
    pauses = swap_pauses(server_samples())
    assert pauses == {0: [(1, 0.002), (2, 0.004)], 1: [(2, 0.003)]}
    restarted = [
        {"time": 0, "server": 0, "swap_pause_count": 5, "swap_pause_last_s": 0.1, "weight_version": 5},
        {"time": 2, "server": 0, "swap_pause_count": 1, "swap_pause_last_s": 0.2, "weight_version": 6},
    ]
    assert swap_pauses(restarted) == {0: [(5, 0.1), (6, 0.2)]}  # a count that falls: the server restarted


def test_busy_fractions_of_trainer_and_servers():
    trainer = [
        {"step": 0, "train_s": 1.0, "publish_s": 0.0, "wait_s": 3.0},
        {"step": 1, "train_s": 2.0, "publish_s": 1.0, "wait_s": 1.0},
    ]
    busy = busy_fractions(trainer, server_samples())
    assert busy == {"trainer": 4.0 / 8.0, "server 0": 1.0, "server 1": 0.5}
    down = {"time": 8.0, "server": 0, "up": False}  # what the sampler writes when a server does not answer
    assert busy_fractions([], [*server_samples(), down])["server 0"] == 4 / 5
    assert trainer_busy_per_step(trainer) == ([0, 1], [0.25, 0.75])
    assert trainer_busy_per_step([{"step": 3, "busy": 0.9}]) == ([3], [0.9])  # logged figure when times are absent
    assert busy_fractions([], []) == {}  # nothing recorded: no bar rather than a made-up 0%


def test_cores_used_per_side_from_the_cpu_samples():
    samples = [
        {"time": 0.0, "cpu_s": {"trainer": 0.0, "rollout": 1.0}},
        {"time": 4.0, "cpu_s": {"trainer": 1.0}},
        {"time": 8.0, "cpu_s": {"trainer": 2.0, "rollout": 13.0}},
    ]
    assert cores_used(samples) == {"trainer": 0.25, "rollout": 1.5}
    assert cores_used(samples[:1]) == {} and cores_used([]) == {}  # one sample: no rate


def test_cores_used_over_a_resumed_run_leave_out_the_stop_and_the_restarted_counts():
    # 100 s at 2 trainer cores and 1 rollout core; stopped; resumed 1000 s later in new CPU groups,
    # whose counts start again at 0, for 100 s more at the same use
    first = [{"time": float(t), "cpu_s": {"trainer": 2.0 * t, "rollout": 1.0 * t}} for t in (0, 50, 100)]
    resumed = [{"time": 1100.0 + t, "cpu_s": {"trainer": 2.0 * t, "rollout": 1.0 * t}} for t in (0, 50, 100)]
    assert cores_used(first + resumed) == {"trainer": 2.0, "rollout": 1.0}
    assert cores_used(first + resumed[:1]) == {"trainer": 2.0, "rollout": 1.0}  # one sample after: no rate yet
    # a sample the groups were already gone for (the end of a run) takes nothing away
    assert cores_used(first + [{"time": 101.0, "cpu_s": {}}]) == {"trainer": 2.0, "rollout": 1.0}


def test_a_resumed_runs_samples_are_their_own_stretch_even_where_no_count_falls():
    # a first run of 10 s at 1 core, then 1000 s later a resumed one whose first count (20 s) is
    # already above the first run's last (10 s): its sampler tells them apart
    first = [{"time": float(t), "cpu_s": {"trainer": 1.0 * t}, "sampler_started": 0.0} for t in (0, 10)]
    resumed = [{"time": 1010.0 + t, "cpu_s": {"trainer": 20.0 + 2.0 * t}, "sampler_started": 1000.0} for t in (0, 90)]
    assert cores_used(first + resumed) == {"trainer": (10.0 + 180.0) / 100.0}


def test_long_runs_average_staleness_over_consecutive_steps():
    rows = [(0, {0: 4.0}, 0.0), (1, {0: 2.0, 1: 2.0}, 2.0), (2, {1: 6.0}, 1.0)]
    assert _binned(rows, 2) == [(0.5, {0: 3.0, 1: 1.0}, 1.0), (2.0, {1: 6.0}, 1.0)]


def test_steps_replayed_after_a_trainer_restart_count_once(tmp_path):
    # the trainer died after step 2's record with its checkpoint at 1: steps 1 and 2 were logged
    # again as replayed; step 4's first record was lost (died after publishing it), its replay stands in
    first = [trainer_step(step) for step in range(3)]
    replayed = [{**trainer_step(step), "replayed": True, "reward_mean": 9.0} for step in (1, 2)]
    last = [trainer_step(3), {**trainer_step(4), "replayed": True}, trainer_step(5)]
    write_jsonl(tmp_path / "trainer" / "metrics.jsonl", first + replayed + last, torn_tail=False)
    run = load_run(tmp_path)
    assert [r["step"] for r in run.trainer] == [0, 1, 2, 3, 4, 5] and run.replayed == 3
    assert [r.get("replayed") for r in run.trainer] == [False] * 4 + [True, False]
    rows = dict(key_figures(run, {}, {}))
    assert rows["trainer steps (replayed after a restart)"] == "6 (3)"
    assert rows["mean reward over the run"] == f"{sum(0.2 + 0.1 * s for s in range(6)) / 6:.3f}"
    assert rows["samples dropped as too stale"] == "3"  # steps 1, 3 and 5 dropped one each
    assert trainer_busy_per_step(run.trainer)[0] == [0, 1, 2, 3, 4, 5]


def test_a_run_without_rl_shows_none_of_an_earlier_runs_rl_records(full_run):
    # the same folder run again with rl_enabled = false: the trainer's, orchestrator's, servers' and
    # CPU records there are the earlier run's, not this one's
    run_dir, _, _ = full_run
    summary = {
        "wall_s": 40.0,
        "heldout_pass1_before": None,
        "heldout_pass1_after": None,
        "stages": {"midtrain": {"val_loss": 1.2}},
        "config": {"name": "demo", "rl_enabled": False},
    }
    (run_dir / "summary.json").write_text(json.dumps(summary))
    run = load_run(run_dir)
    assert run.trainer == run.orchestrator == run.servers == run.cpu == [] and run.before == run.after == {}
    page = write_report(run_dir).read_text()
    assert "<img " not in page
    for what in ("trainer steps (replayed after a restart)", "final reward (mean over the last batch)"):
        assert f"<tr><td>{what}</td><td>not recorded</td></tr>" in page
