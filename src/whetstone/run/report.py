"""`runs/<name>/report.html`: one self-contained page (inline PNGs, inline CSS) of what a run did.

It reads whatever the run left behind and never fails on a missing, partial or torn file, so a
run killed midway still gets its report; a section without data says "not recorded".

    summary.json                  wall time, held-out pass@1 before/after, the temperature sweeps
                                  compared (envs/eval/sweep.py), config
    trainer/metrics.jsonl         one record per optimizer step
    orchestrator/metrics.jsonl    one record per batch put
    servers.jsonl                 samples of each inference server, about every 2 s
    eval/{before,after}/report.json   the held-out evaluations (pass@k, at each temperature)
"""

from __future__ import annotations

import contextlib
import datetime
import html
import json
import statistics
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from whetstone.config import without_secrets
from whetstone.errors import WhetstoneError
from whetstone.run import plots
from whetstone.run.monitor import read_json_object
from whetstone.run.plots import number, staleness_counts
from whetstone.utils.atomic import atomic_write_text, write_errors
from whetstone.utils.metrics import read_metrics

NOT_RECORDED = "not recorded"


@dataclass
class RunRecords:
    """What a run folder holds; a part missing or unreadable is empty ({}, [] or None)."""

    name: str
    summary: dict
    summary_mtime: float | None
    config_toml: str | None
    trainer: list[dict]
    """One record per trainer step (`trainer_steps`: a step replayed after a restart counts once)."""
    orchestrator: list[dict]
    servers: list[dict]
    cpu: list[dict]
    before: dict
    after: dict
    replayed: int = field(init=False)
    """Trainer steps trained again after a restart (their records left out of `trainer`)."""

    def __post_init__(self) -> None:
        self.replayed = sum(record.get("replayed") is True for record in self.trainer)
        self.trainer = trainer_steps(self.trainer)


def trainer_steps(records: list[dict]) -> list[dict]:
    """The trainer's metrics records, one per step. After a restart the trainer replays the steps
    since its checkpoint and logs them again, marked `replayed`: the batch and the weights are the
    ones the first record describes, so counting both would weigh those steps twice. A replayed
    record stands in only for a step whose first record is missing (the process died between
    publishing the step and writing it)."""
    first = {record.get("step") for record in records if record.get("replayed") is not True}
    kept, seen = [], set()
    for record in records:
        step = record.get("step")
        if record.get("replayed") is True and (step in first or step in seen):
            continue
        seen.add(step)
        kept.append(record)
    return kept


def _read_text(path: Path) -> str | None:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return None


def _read_jsonl(path: Path) -> list[dict]:
    try:
        return read_metrics(path)
    except OSError:
        return []


def _evaluation(run_dir: Path, when: str, summary: dict) -> dict:
    """The evaluation report `when` ("before"/"after" RL), unless the run's summary says it made
    no such evaluation (`heldout_pass1_<when>` null): a report in the folder is then an earlier
    run's (a rerun whose RL made no step leaves the last one's `eval/after`)."""
    if f"heldout_pass1_{when}" in summary and summary[f"heldout_pass1_{when}"] is None:
        return {}
    return read_json_object(run_dir / "eval" / when / "report.json")


def _without_rl(summary: dict) -> bool:
    """Whether the run's summary says it ran no RL stage (`rl_enabled` false): the RL stage's
    records in the folder (trainer, orchestrator, servers, CPU) are then an earlier run's."""
    config = summary.get("config")
    return isinstance(config, dict) and config.get("rl_enabled") is False


def load_run(run_dir: Path) -> RunRecords:
    summary_path, config_path = run_dir / "summary.json", run_dir / "config.toml"
    summary = read_json_object(summary_path)
    without_rl = _without_rl(summary)

    def rl_records(path: Path) -> list[dict]:
        return [] if without_rl else _read_jsonl(path)

    return RunRecords(
        name=run_dir.resolve().name,
        summary=summary,
        summary_mtime=summary_path.stat().st_mtime if summary_path.is_file() else None,
        config_toml=_read_text(config_path),
        trainer=rl_records(run_dir / "trainer" / "metrics.jsonl"),
        orchestrator=rl_records(run_dir / "orchestrator" / "metrics.jsonl"),
        servers=rl_records(run_dir / "servers.jsonl"),
        cpu=rl_records(run_dir / "cpu.jsonl"),
        before=_evaluation(run_dir, "before", summary),
        after=_evaluation(run_dir, "after", summary),
    )


def pass_at_k(report: dict) -> dict[int, float]:
    """An evaluation report's pass@k as {k: score}, scores that are not numbers left out."""
    values = report.get("pass_at_k")
    scores = {int(k): number(v) for k, v in values.items() if str(k).isdigit()} if isinstance(values, dict) else {}
    return {k: score for k, score in scores.items() if score is not None}


def heldout_pass1(run: RunRecords, when: str) -> float | None:
    """pass@1 `when` ("before"/"after") RL: the summary's figure, else the evaluation report's."""
    value = number(run.summary.get(f"heldout_pass1_{when}"))
    return value if value is not None else pass_at_k(getattr(run, when)).get(1)


@dataclass
class TemperatureCurves:
    """Held-out pass@1 by sampling temperature before and after RL, each one's best temperature
    (None where not known), and the logit scale RL learned."""

    before: dict[float, float]
    after: dict[float, float]
    best: tuple[float | None, float | None]
    logit_scale: float | None


def _curve(points) -> dict[float, float]:
    """{temperature: pass@1} of the summary's sweep points."""
    if not isinstance(points, list):
        return {}
    pairs = [(number(p.get("temperature")), number(p.get("pass1"))) for p in points if isinstance(p, dict)]
    return {t: p for t, p in pairs if t is not None and p is not None}


def _report_curve(report: dict) -> dict[float, float]:
    """{temperature: pass@1} of an evaluation report's sweep."""
    points = report.get("temperatures")
    if not isinstance(points, list):
        return {}
    return _curve(
        [{"temperature": p.get("temperature"), "pass1": pass_at_k(p).get(1)} for p in points if isinstance(p, dict)]
    )


def _best(point) -> float | None:
    return number(point.get("temperature")) if isinstance(point, dict) else None


def temperature_curves(run: RunRecords) -> TemperatureCurves:
    """The summary's temperature sweeps; for a run stopped before its summary, the evaluation
    reports' (with the trainer's last logit scale)."""
    sweep = run.summary.get("temperature_sweep")
    if isinstance(sweep, dict):
        return TemperatureCurves(
            _curve(sweep.get("before")),
            _curve(sweep.get("after")),
            (_best(sweep.get("best_before")), _best(sweep.get("best_after"))),
            number(sweep.get("logit_scale")),
        )
    return TemperatureCurves(
        _report_curve(run.before), _report_curve(run.after), (None, None), _last(_column(run.trainer, "logit_scale"))
    )


def _gain(summary: dict, key: str) -> str:
    """A gain of the summary in points, with its paired standard error."""
    value, se = number(summary.get(key)), number(summary.get(f"{key}_se"))
    if value is None:
        return NOT_RECORDED
    return f"{value * 100:+.1f}" + (f" ± {se * 100:.1f}" if se is not None else "") + " points"


def _sweep_point(sweep, key: str) -> str:
    """A best temperature of the summary's sweep and its pass@1 (and the effective temperature after RL)."""
    point = sweep.get(key) if isinstance(sweep, dict) else None
    t, pass1 = (
        (number(point.get("temperature")), number(point.get("pass1"))) if isinstance(point, dict) else (None, None)
    )
    if t is None or pass1 is None:
        return NOT_RECORDED
    effective = number(point.get("effective_temperature"))
    shown = f"T = {t:.3g}" + (f" (effective {effective:.3g})" if effective is not None and effective != t else "")
    return f"{pass1:.3f} at {shown}"


def _crossfit(sweep) -> str:
    gain = sweep.get("gain_over_best_temperature_crossfit") if isinstance(sweep, dict) else None
    if not isinstance(gain, dict):
        return NOT_RECORDED
    return _gain({"g": gain.get("value"), "g_se": gain.get("se")}, "g")


def yardstick_figures(run: RunRecords) -> list[tuple[str, str]]:
    """The held-out figures against each model at its best temperature, as (what, value) rows."""
    summary, sweep = run.summary, run.summary.get("temperature_sweep")
    frozen_at = number(sweep.get("scale_frozen_temperature")) if isinstance(sweep, dict) else None
    return [
        ("temperature of the held-out pass@1 above", _fmt(number(summary.get("headline_temperature")), "{:.3g}")),
        ("held-out pass@1 before RL at its best temperature", _sweep_point(sweep, "best_before")),
        ("held-out pass@1 after RL at its best temperature", _sweep_point(sweep, "best_after")),
        ("gain over the best temperature (± paired SE)", _gain(summary, "gain_over_best_temperature")),
        ("the same, each half of the tasks at the temperatures best on the other half", _crossfit(sweep)),
        (
            "gain with the learned logit scale removed (after RL sampled at T = "
            f"{_fmt(frozen_at, '{:.3g}')}; ± paired SE)",
            _gain(summary, "gain_scale_frozen"),
        ),
    ]


def swap_pauses(servers: list[dict]) -> dict[int, list[tuple[float | None, float]]]:
    """Each server's swaps as (weight version swapped to, pause seconds), from the rises of its
    swap count between samples. Samples are ~2 s apart, so several swaps between two samples
    show as one (the last pause)."""
    counts: dict[int, float] = {}
    pauses: dict[int, list[tuple[float | None, float]]] = {}
    for sample in sorted(servers, key=lambda s: number(s.get("time")) or 0.0):
        server, count = number(sample.get("server")), number(sample.get("swap_pause_count"))
        if server is None or count is None:
            continue
        server, previous = int(server), counts.get(int(server), 0.0)
        counts[server] = count
        if count < previous:  # the server restarted: its count began again at 0
            previous = 0.0
        pause, swaps = number(sample.get("swap_pause_last_s")), pauses.setdefault(server, [])
        if count > previous and pause is not None:
            swaps.append((number(sample.get("weight_version")), pause))
    return pauses


def _step_time(record: dict) -> tuple[float, float] | None:
    """(working, waiting) seconds of one trainer step: train_s + publish_s, wait_s."""
    train, wait = number(record.get("train_s")), number(record.get("wait_s"))
    if train is None or wait is None:
        return None
    return train + (number(record.get("publish_s")) or 0.0), max(wait, 0.0)


def trainer_busy_per_step(trainer: list[dict]) -> tuple[list[float], list[float]]:
    """Each step's busy fraction from its timings, else the `busy` it logged."""
    steps, fractions = [], []
    for record in trainer:
        step, timing = number(record.get("step")), _step_time(record)
        fraction = timing[0] / sum(timing) if timing and sum(timing) > 0 else number(record.get("busy"))
        if step is not None and fraction is not None:
            steps.append(step), fractions.append(fraction)
    return steps, fractions


def busy_fractions(trainer: list[dict], servers: list[dict]) -> dict[str, float]:
    """Share of wall time each role was working: the trainer Σ(train + publish) / Σ(train +
    publish + wait) over its steps, each server the share of its samples with a running sequence
    (a sample of a server that was down counts as idle)."""
    busy: dict[str, float] = {}
    timings = [t for t in map(_step_time, trainer) if t is not None]
    total = sum(work + wait for work, wait in timings)
    if total > 0:
        busy["trainer"] = sum(work for work, _ in timings) / total
    running: dict[int, list[bool]] = {}
    for sample in servers:
        server, sequences = number(sample.get("server")), number(sample.get("running_sequences"))
        if server is not None and (sequences is not None or sample.get("up") is False):
            running.setdefault(int(server), []).append(sequences is not None and sequences > 0)
    busy.update({f"server {s}": sum(flags) / len(flags) for s, flags in sorted(running.items())})
    return busy


def cores_used(cpu: list[dict]) -> dict[str, float]:
    """Average cores each side (trainer; rollout: servers, orchestrator, sandboxes) used while the
    roles ran: its CPU seconds over the wall time between its first and last count in `cpu.jsonl`.
    A resumed run appends to the file from a new sampler (`sampler_started`) and new groups, whose
    counts start again at 0: the samples are cut into stretches where the sampler changes (or, in
    a file written without it, where a count falls), each stretch counts on its own, and the time
    between them (the run stopped) not at all."""
    stretches: list[list[tuple[float, dict[str, float]]]] = []
    sampler: object = None
    seen: dict[str, float] = {}
    for record in cpu:
        if number(record.get("time")) is None or not isinstance(record.get("cpu_s"), dict):
            continue
        counts = {side: number(value) for side, value in record["cpu_s"].items()}
        counts = {side: value for side, value in counts.items() if value is not None}
        fell = any(counts[side] < seen[side] for side in counts.keys() & seen.keys())
        if not stretches or record.get("sampler_started") != sampler or fell:
            stretches.append([])
            sampler, seen = record.get("sampler_started"), {}
        stretches[-1].append((record["time"], counts))
        seen.update(counts)
    used: dict[str, float] = {}
    wall: dict[str, float] = {}
    for stretch in stretches:
        for side in {side for _, counts in stretch for side in counts}:
            points = [(time, counts[side]) for time, counts in stretch if side in counts]
            (start, first), (end, last) = points[0], points[-1]
            if end > start:
                used[side] = used.get(side, 0.0) + last - first
                wall[side] = wall.get(side, 0.0) + end - start
    return {side: used[side] / wall[side] for side in used}


def _mean(values: list[float]) -> float | None:
    return statistics.fmean(values) if values else None


def _last(values: list[float]) -> float | None:
    return values[-1] if values else None


def _fmt(value: float | None, style: str = "{:.4g}") -> str:
    return NOT_RECORDED if value is None else style.format(value)


def _bytes(value: float | None) -> str:
    if value is None:
        return NOT_RECORDED
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if value >= size:
            return f"{value / size:.3g} {unit}"
    return f"{value:.0f} B"


def _column(records: list[dict], key: str) -> list[float]:
    return [v for v in (number(r.get(key)) for r in records) if v is not None]


def _entropy_span(trainer: list[dict]) -> str:
    """RL sharpens the policy: how far the entropy of its next-token distributions fell."""
    entropy = _column(trainer, "entropy")
    return f"{entropy[0]:.3g} / {entropy[-1]:.3g}" if entropy else NOT_RECORDED


def _logit_scale(trainer: list[dict]) -> str:
    """How much RL sharpened the policy as a whole (`TrainerConfig.logit_scale_lr`)."""
    scales = _column(trainer, "logit_scale")
    if not trainer:
        return NOT_RECORDED
    return f"{scales[-1]:.3f}" if scales else "off (logit_scale_lr 0)"


def _anchor_span(trainer: list[dict]) -> str:
    """How well the policy still fits the mid-training demonstrations (`TrainerConfig.demo_coef`)."""
    nll = _column(trainer, "demo_nll")
    if not trainer:
        return NOT_RECORDED
    return f"{nll[0]:.3g} / {nll[-1]:.3g}" if nll else "off (demo_coef 0)"


def _rl_stage(summary: dict) -> dict:
    """The summary's RL stage record ({} when the run had none, or has no summary yet)."""
    stages = summary.get("stages")
    rl = stages.get("rl") if isinstance(stages, dict) else None
    return rl if isinstance(rl, dict) else {}


def _rl_steps(summary: dict) -> str:
    """RL's steps made of those planned, and what ended it early: `rl.max_wall_time`, or the
    orchestrator giving up (`orchestrator.max_fruitless_batches`)."""
    rl = _rl_stage(summary)
    made, planned = number(rl.get("steps")), number(rl.get("steps_planned"))
    if made is None or planned is None:
        return NOT_RECORDED
    if rl.get("stopped_at_wall_time"):
        return f"{made:.0f} / {planned:.0f} (stopped at rl.max_wall_time)"
    if rl.get("orchestrator_stopped"):
        return f"{made:.0f} / {planned:.0f} (the orchestrator stopped: {rl['orchestrator_stopped']})"
    return f"{made:.0f} / {planned:.0f}"


def key_figures(run: RunRecords, pauses: dict, busy: dict[str, float]) -> list[tuple[str, str]]:
    """The numbers behind the plots, as (what, value) rows."""
    trainer = run.trainer
    deltas = [r for r in trainer if r.get("delta_kind") == "delta"]
    full = [r for r in trainer if r.get("delta_kind") == "full"]
    rewards = _column(trainer, "reward_mean") or _column(run.orchestrator, "reward_mean")
    kl, versions = _column(trainer, "mismatch_kl_k3"), _column(trainer, "version")
    disagreement = _column(trainer, "routing_disagreement")
    pause_ms = sorted(p * 1e3 for points in pauses.values() for _, p in points)
    pause_spread = f"{statistics.median(pause_ms):.3g} / {pause_ms[-1]:.3g} ms" if pause_ms else NOT_RECORDED
    steps = f"{len(trainer)} ({run.replayed})" if trainer else NOT_RECORDED
    dropped = sum(staleness_counts(r.get("staleness_histogram"))[1] for r in trainer)
    rows = [
        ("held-out pass@1 before RL", _fmt(heldout_pass1(run, "before"), "{:.3f}")),
        ("held-out pass@1 after RL", _fmt(heldout_pass1(run, "after"), "{:.3f}")),
        *yardstick_figures(run),
        ("RL steps made / planned", _rl_steps(run.summary)),
        ("trainer steps (replayed after a restart)", steps),
        ("batches put by the orchestrator", str(len(run.orchestrator)) if run.orchestrator else NOT_RECORDED),
        ("final reward (mean over the last batch)", _fmt(_last(rewards), "{:.3f}")),
        ("mean reward over the run", _fmt(_mean(rewards), "{:.3f}")),
        ("mean k3 KL, trainer vs rollout", _fmt(_mean(kl), "{:.3g}")),
        ("max k3 KL", _fmt(max(kl, default=None), "{:.3g}")),
        ("mean routing disagreement (router choices)", _fmt(_mean(disagreement), "{:.2%}")),
        ("max |logprob difference|", _fmt(max(_column(trainer, "logprob_diff_max"), default=None), "{:.3g}")),
        ("policy entropy, first / last step (nats per trained token)", _entropy_span(trainer)),
        ("learned logit scale after the last step", _logit_scale(trainer)),
        ("demonstration loss, first / last step (anchor; nats per trained token)", _anchor_span(trainer)),
        ("mean clip fraction", _fmt(_mean(_column(trainer, "clip_fraction")), "{:.2%}")),
        ("mean mask fraction", _fmt(_mean(_column(trainer, "mask_fraction")), "{:.2%}")),
        ("samples dropped as too stale", f"{dropped:.0f}" if trainer else NOT_RECORDED),
        ("versions published (full)", f"{len(versions)} ({len(full)})" if versions else NOT_RECORDED),
        ("mean delta size (delta versions)", _bytes(_mean(_column(deltas, "delta_bytes")))),
        ("mean delta ratio (delta versions)", _fmt(_mean(_column(deltas, "delta_ratio")), "{:.1f}x")),
        ("mean full version size", _bytes(_mean(_column(full, "delta_bytes")))),
        ("swap pauses seen", str(len(pause_ms)) if pauses else NOT_RECORDED),
        ("swap pause p50 / max", pause_spread),
    ]
    busy_rows = [(f"{role} busy", f"{fraction:.1%}") for role, fraction in busy.items()]
    cores = cores_used(run.cpu)
    cpu_row = (
        "CPU used while the roles ran, trainer / rollout side (cores)",
        " / ".join(f"{cores[side]:.2f}" for side in ("trainer", "rollout") if side in cores) or NOT_RECORDED,
    )
    return rows + (busy_rows or [("busy fractions", NOT_RECORDED)]) + [cpu_row]


STYLE = """
body { font: 14px/1.45 system-ui, sans-serif; max-width: 920px; margin: 2em auto; padding: 0 1em; color: #222; }
h1 { margin-bottom: .2em; } h2 { margin-top: 1.6em; border-bottom: 1px solid #ddd; }
.meta { color: #666; } .headline { font-size: 1.6em; font-weight: 600; margin: .6em 0; }
.missing { color: #a33; font-style: italic; } .reads { color: #777; font-size: .85em; }
table { border-collapse: collapse; } td { padding: .2em .8em; border-bottom: 1px solid #eee; }
td:last-child { text-align: right; font-variant-numeric: tabular-nums; }
pre { background: #f6f6f6; padding: 1em; overflow-x: auto; font-size: 12px; }
"""


def _header(run: RunRecords) -> str:
    before, after = heldout_pass1(run, "before"), heldout_pass1(run, "after")
    delta = f" ({(after - before) * 100:+.1f} points)" if before is not None and after is not None else ""
    at = number(run.summary.get("headline_temperature"))
    temperature = f" at temperature {at:g}" if at is not None else ""
    headline = f"held-out pass@1{temperature}: {_fmt(before, '{:.1%}')} → {_fmt(after, '{:.1%}')}{delta}"
    if number(run.summary.get("gain_over_best_temperature")) is not None:
        gain = _gain(run.summary, "gain_over_best_temperature")
        headline += f"<br>each at its best temperature: {gain} (paired SE)"
    rl = _rl_stage(run.summary)
    if rl.get("no_step_reason"):
        why = html.escape(str(rl["no_step_reason"]))
        headline += f"<br>RL made no step, so the final policy is the mid-trained one: {why}"
    elif rl.get("orchestrator_stopped"):
        why = html.escape(str(rl["orchestrator_stopped"]))
        headline += (
            f"<br>RL ended at step {rl.get('steps')} of {rl.get('steps_planned')}: the orchestrator stopped ({why})"
        )
    if run.summary_mtime is not None:
        date = f"finished {datetime.datetime.fromtimestamp(run.summary_mtime):%Y-%m-%d %H:%M}"
    else:
        date = f"did not finish (no summary.json); report written {datetime.datetime.now():%Y-%m-%d %H:%M}"
    wall = number(run.summary.get("wall_s"))
    wall_text = NOT_RECORDED if wall is None else f"{wall:.0f} s ({wall / 60:.1f} min)"
    return (
        f"<h1>whetstone run: {html.escape(run.name)}</h1>\n<p class='meta'>{date} · wall time {wall_text}</p>\n"
        f"<p class='headline'>{headline}</p>"
    )


def _section(title: str, image: str | None, reads: str) -> str:
    body = (
        f"<img alt='{html.escape(title)}' src='data:image/png;base64,{image}'>"
        if image
        else f"<p class='missing'>{NOT_RECORDED}</p>"
    )
    return f"<h2>{html.escape(title)}</h2>\n{body}\n<p class='reads'>{html.escape(reads)}</p>"


def _config(run: RunRecords) -> str:
    """The run's config as summary.json has it, else (a run stopped before its summary) as it
    started, from config.toml; either with its secrets as `***` (`without_secrets`): config.toml
    keeps them as given, and the page is for sharing."""
    config = run.summary.get("config")
    if not isinstance(config, dict) and run.config_toml is not None:
        with contextlib.suppress(tomllib.TOMLDecodeError):
            config = without_secrets(tomllib.loads(run.config_toml))
    if not isinstance(config, dict):
        return f"<h2>Config</h2>\n<p class='missing'>{NOT_RECORDED}</p>"
    text = json.dumps(config, indent=2, sort_keys=True)
    return f"<h2>Config</h2>\n<details><summary>the run's config</summary><pre>{html.escape(text)}</pre></details>"


def render_report(run: RunRecords) -> str:
    pauses, busy = swap_pauses(run.servers), busy_fractions(run.trainer, run.servers)
    curves = temperature_curves(run)
    sections = [
        _section(
            "Reward",
            plots.reward_plot(run.trainer, run.orchestrator),
            "trainer/metrics.jsonl reward_mean per step; orchestrator/metrics.jsonl reward_mean per batch",
        ),
        _section(
            "Held-out pass@k",
            plots.passk_plot(
                pass_at_k(run.before) or _summary_pass1(run, "before"),
                pass_at_k(run.after) or _summary_pass1(run, "after"),
            ),
            "eval/before/report.json and eval/after/report.json pass_at_k (else summary.json pass@1)",
        ),
        _section(
            "Held-out pass@1 by sampling temperature",
            plots.temperature_plot(curves.before, curves.after, curves.logit_scale, curves.best),
            "summary.json temperature_sweep (else eval/before/report.json and eval/after/report.json "
            "temperatures, and the trainer's last logit_scale); stars: each curve's best",
        ),
        _section(
            "Staleness",
            plots.staleness_plot(run.trainer),
            "trainer/metrics.jsonl staleness_histogram: samples per step by how many versions behind",
        ),
        _section(
            "Weight sync",
            plots.weight_sync_plot(run.trainer, pauses),
            "trainer/metrics.jsonl version, delta_bytes, delta_kind; servers.jsonl rises of swap_pause_count "
            "(pause = swap_pause_last_s)",
        ),
        _section(
            "Trainer–rollout mismatch",
            plots.mismatch_plot(run.trainer),
            "trainer/metrics.jsonl mismatch_kl_k3, routing_disagreement, routing_disagreement_tokens",
        ),
        _section(
            "Busy fraction",
            plots.busy_plot(busy, trainer_busy_per_step(run.trainer)),
            "trainer: (train_s + publish_s) / (train_s + publish_s + wait_s); "
            "server: share of servers.jsonl samples with running_sequences > 0",
        ),
    ]
    table = "\n".join(
        f"<tr><td>{html.escape(what)}</td><td>{html.escape(value)}</td></tr>"
        for what, value in key_figures(run, pauses, busy)
    )
    return (
        f"<!doctype html>\n<html><head><meta charset='utf-8'><title>whetstone run {html.escape(run.name)}</title>"
        f"<style>{STYLE}</style></head><body>\n{_header(run)}\n"
        + "\n".join(sections)
        + f"\n<h2>Key figures</h2>\n<table>{table}</table>\n{_config(run)}\n</body></html>\n"
    )


def _summary_pass1(run: RunRecords, when: str) -> dict[int, float]:
    value = number(run.summary.get(f"heldout_pass1_{when}"))
    return {} if value is None else {1: value}


def write_report(run_dir: str | Path) -> Path:
    """Write `run_dir/report.html` (atomically) from whatever the run wrote; return its path. A
    page that cannot be written (a full disk) is a WhetstoneError naming it."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise WhetstoneError(f"no run folder at {run_dir}")
    path = run_dir / "report.html"
    page = render_report(load_run(run_dir))
    with write_errors(path):
        atomic_write_text(path, page)
    return path
