"""The figures of the run report, one function per plot.

Each returns the figure as a base64 PNG, or None when its data was not recorded. Figures are
`matplotlib.figure.Figure` objects rendered by Agg, never pyplot: there is no global figure
registry to leak into and no GUI backend to pick, so this works headless and in any process.
Bad values (null, NaN, text) are skipped point by point, never plotted and never fatal.
"""

from __future__ import annotations

import base64
import io
import math
import re
from typing import Any

WIDTH, HEIGHT, DPI = 6.0, 2.6, 90
MAX_BARS = 100  # per figure
_STALENESS_KEY = re.compile(r"(?:staleness_)?(\d+)")


def number(value: Any) -> float | None:
    """`value` as a finite float, or None (missing, null, NaN, infinite, bool, text)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    value = float(value)
    return value if math.isfinite(value) else None


def series(records: list[dict], x_key: str, y_key: str) -> tuple[list[float], list[float]]:
    """The (x, y) points of `records` where both keys hold a number."""
    points = [(number(r.get(x_key)), number(r.get(y_key))) for r in records]
    points = [(x, y) for x, y in points if x is not None and y is not None]
    return [x for x, _ in points], [y for _, y in points]


def staleness_counts(histogram: Any) -> tuple[dict[int, float], float]:
    """Samples kept per staleness (steps behind) and samples dropped as too stale.

    Reads the trainer's `{"staleness_0": n, ..., "dropped_stale": n}` and the plain `{"0": n}`.
    """
    kept: dict[int, float] = {}
    if not isinstance(histogram, dict):
        return kept, 0.0
    for key, value in histogram.items():
        match, count = _STALENESS_KEY.fullmatch(str(key)), number(value)
        if match and count is not None:
            kept[int(match.group(1))] = count
    return kept, number(histogram.get("dropped_stale")) or 0.0


def _figure(panels: int = 1):
    from matplotlib.figure import Figure

    figure = Figure(figsize=(WIDTH, HEIGHT), dpi=DPI)
    return figure, figure.subplots(1, panels)


def _png(figure) -> str:
    figure.tight_layout()
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=DPI)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def _style(axes, xlabel: str, ylabel: str, legend: bool = True) -> None:
    axes.set_xlabel(xlabel, fontsize=8)
    axes.set_ylabel(ylabel, fontsize=8)
    axes.tick_params(labelsize=7)
    axes.grid(alpha=0.3)
    if legend and axes.get_legend_handles_labels()[0]:
        axes.legend(fontsize=7)


def _not_recorded(axes) -> None:
    axes.text(0.5, 0.5, "not recorded", ha="center", va="center", transform=axes.transAxes, color="grey")
    axes.set_xticks([]), axes.set_yticks([])


def reward_plot(trainer: list[dict], orchestrator: list[dict]) -> str | None:
    """Mean reward of the batch each trainer step trained on, and of each batch the orchestrator put."""
    steps, rewards = series(trainer, "step", "reward_mean")
    batches, batch_rewards = series(orchestrator, "index", "reward_mean")
    if not rewards and not batch_rewards:
        return None
    figure, axes = _figure()
    if rewards:
        axes.plot(steps, rewards, marker=".", label="trainer step")
    if batch_rewards:
        axes.plot(batches, batch_rewards, ls="none", marker="x", label="orchestrator batch")
    _style(axes, "trainer step / batch index", "mean reward")
    return _png(figure)


def passk_plot(before: dict[int, float], after: dict[int, float]) -> str | None:
    """Held-out pass@k before and after RL, side by side for every k either evaluation reported."""
    ks = sorted(set(before) | set(after))
    if not ks:
        return None
    figure, axes = _figure()
    for offset, label, values in ((-0.2, "before RL", before), (0.2, "after RL", after)):
        shown = [(i + offset, values[k]) for i, k in enumerate(ks) if k in values]
        if shown:
            bars = axes.bar([x for x, _ in shown], [y for _, y in shown], 0.38, label=label)
            axes.bar_label(bars, fmt="%.3f", fontsize=7)
    axes.set_xticks(range(len(ks)), [f"pass@{k}" for k in ks])
    axes.set_ylim(0, 1.15)
    _style(axes, "", "held-out")
    return _png(figure)


def _binned(rows: list[tuple[float, dict[int, float], float]], size: int):
    """Rows of (step, kept per staleness, dropped) averaged over runs of `size` consecutive steps,
    each placed at its middle step: thousands of bars take matplotlib tens of seconds to draw."""
    out = []
    for start in range(0, len(rows), size):
        chunk = rows[start : start + size]
        levels = {level for _, kept, _ in chunk for level in kept}
        kept = {level: sum(k.get(level, 0.0) for _, k, _ in chunk) / len(chunk) for level in levels}
        out.append((sum(step for step, _, _ in chunk) / len(chunk), kept, sum(d for _, _, d in chunk) / len(chunk)))
    return out


def staleness_plot(trainer: list[dict]) -> str | None:
    """Samples of each trainer step's batch stacked by staleness; dropped (too stale) ones hatched
    on top. Past MAX_BARS steps, each bar is the mean of several consecutive steps."""
    rows = [(number(r.get("step")), *staleness_counts(r.get("staleness_histogram"))) for r in trainer]
    rows = [(step, kept, dropped) for step, kept, dropped in rows if step is not None and (kept or dropped)]
    if not rows:
        return None
    import matplotlib

    size = math.ceil(len(rows) / MAX_BARS)
    rows = _binned(rows, size) if size > 1 else rows
    figure, axes = _figure()
    steps, bottom, width = [step for step, _, _ in rows], [0.0] * len(rows), 0.8 * size
    levels = sorted({level for _, kept, _ in rows for level in kept})
    colors = matplotlib.colormaps["viridis"]
    for i, level in enumerate(levels):
        heights = [kept.get(level, 0.0) for _, kept, _ in rows]
        axes.bar(
            steps,
            heights,
            width,
            bottom=bottom,
            color=colors(i / max(len(levels) - 1, 1)),
            label=f"{level} step{'s' if level != 1 else ''} stale",
        )
        bottom = [b + h for b, h in zip(bottom, heights)]
    dropped = [d for _, _, d in rows]
    if any(dropped):
        axes.bar(steps, dropped, width, bottom=bottom, color="none", edgecolor="grey", hatch="//", label="dropped")
    axes.set_ylim(0, max(b + d for b, d in zip(bottom, dropped)) * 1.4)  # headroom: the legend sits above the bars
    _style(axes, "trainer step", "samples" if size == 1 else f"samples (mean of {size} steps)", legend=False)
    axes.legend(fontsize=7, ncol=min(len(levels) + 1, 5), loc="upper left")
    return _png(figure)


def weight_sync_plot(trainer: list[dict], pauses: dict[int, list[tuple[float | None, float]]]) -> str | None:
    """Left: bytes of each published version (log scale, full versions marked). Right: each
    server's swap pauses against the weight version it swapped to."""
    published = [(number(r.get("version")), number(r.get("delta_bytes")), r.get("delta_kind")) for r in trainer]
    published = [(v, b, kind) for v, b, kind in published if v is not None and b is not None and b > 0]
    swaps = {server: [(v, p) for v, p in points if v is not None] for server, points in pauses.items()}
    if not published and not any(swaps.values()):
        return None
    figure, (sizes, pause_axes) = _figure(2)
    if published:
        sizes.plot([v for v, _, _ in published], [b for _, b, _ in published], marker=".", label="published")
        full = [(v, b) for v, b, kind in published if kind == "full"]
        if full:
            sizes.scatter([v for v, _ in full], [b for _, b in full], marker="^", color="C3", zorder=3, label="full")
        sizes.set_yscale("log")
        _style(sizes, "weight version", "bytes")
    else:
        _not_recorded(sizes)
    if any(swaps.values()):
        for server, points in sorted(swaps.items()):
            pause_axes.plot(
                [v for v, _ in points],
                [p * 1e3 for _, p in points],
                ls="none",
                marker="o",
                markersize=4,
                label=f"server {server}",
            )
        _style(pause_axes, "weight version swapped to", "swap pause (ms)")
    else:
        _not_recorded(pause_axes)
    return _png(figure)


def mismatch_plot(trainer: list[dict]) -> str | None:
    """Trainer vs rollout policy per step: k3 KL (left) and routing disagreement (right)."""
    kl = series(trainer, "step", "mismatch_kl_k3")
    choices = series(trainer, "step", "routing_disagreement")
    tokens = series(trainer, "step", "routing_disagreement_tokens")
    if not kl[1] and not choices[1]:
        return None
    figure, (kl_axes, routing_axes) = _figure(2)
    if kl[1]:
        kl_axes.plot(*kl, marker=".")
        _style(kl_axes, "trainer step", "k3 KL", legend=False)
    else:
        _not_recorded(kl_axes)
    if choices[1]:
        routing_axes.plot(*choices, marker=".", label="router choices")
        if tokens[1]:
            routing_axes.plot(*tokens, ls="--", label="tokens (any layer)")
        _style(routing_axes, "trainer step", "routing disagreement")
    else:
        _not_recorded(routing_axes)
    return _png(figure)


def busy_plot(busy: dict[str, float], trainer_steps: tuple[list[float], list[float]]) -> str | None:
    """Left: busy fraction of each role over the run. Right: the trainer's busy fraction per step."""
    if not busy and not trainer_steps[1]:
        return None
    figure, (roles, per_step) = _figure(2)
    if busy:
        bars = roles.bar(list(busy), list(busy.values()), color="C2")
        roles.bar_label(bars, labels=[f"{v:.0%}" for v in busy.values()], fontsize=7)
        roles.set_ylim(0, 1.15)
        _style(roles, "", "busy fraction", legend=False)
    else:
        _not_recorded(roles)
    if trainer_steps[1]:
        per_step.plot(*trainer_steps, marker=".", color="C2")
        per_step.set_ylim(0, 1.05)
        _style(per_step, "trainer step", "trainer busy", legend=False)
    else:
        _not_recorded(per_step)
    return _png(figure)


def temperature_plot(
    before: dict[float, float],
    after: dict[float, float],
    logit_scale: float | None,
    best: tuple[float | None, float | None] = (None, None),
) -> str | None:
    """Held-out pass@1 against the sampling temperature, before and after RL, each curve's best
    temperature (`best`, before and after) starred. With a learned logit scale, a right panel
    puts the trained model at its effective temperature T / scale, the temperature of the base's
    scale: there the two curves differ only by what RL taught besides the sharpness."""
    if not before and not after:
        return None
    scaled = logit_scale is not None and logit_scale != 1.0
    figure, panels = _figure(2 if scaled else 1)
    panels = list(panels) if scaled else [panels]
    for axes, scale, xlabel in zip(
        panels, (1.0, logit_scale), ("sampling temperature", "effective temperature (T / learned logit scale)")
    ):
        for label, curve, divide, star in (("before RL", before, 1.0, best[0]), ("after RL", after, scale, best[1])):
            if not curve:
                continue
            points = sorted(curve.items())
            (line,) = axes.plot([t / divide for t, _ in points], [p for _, p in points], marker=".", label=label)
            if star in curve:
                axes.plot([star / divide], [curve[star]], marker="*", markersize=11, color=line.get_color(), ls="none")
        axes.set_ylim(0, 1.05)
        _style(axes, xlabel, "held-out pass@1")
    return _png(figure)
