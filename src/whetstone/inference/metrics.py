"""Engine counters, and their Prometheus text exposition for `/metrics`.

The engine thread writes these; HTTP handlers only read them (plain ints and floats, so a read
never blocks the engine and at worst sees the previous step's value).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

TOKENS_PER_S_WINDOW = 10.0


@dataclass
class WeightsReport:
    """Where a server following a weight store stands (`WeightFollower.report`)."""

    latest_version: int | None
    """The store's newest version at the subscriber's last poll."""
    rejected: dict[int, str]
    """Versions newer than the one served that were rejected or refused, with the reason."""
    rejections_total: int
    problem: str | None
    """Why the server cannot take the store's newest version (None: it holds it or is on its way)."""


@dataclass
class EngineStats:
    weight_version: int = 0
    running: int = 0
    waiting_interactive: int = 0
    waiting_batch: int = 0
    prompt_tokens_total: int = 0
    prompt_tokens_shared_total: int = 0
    generation_tokens_total: int = 0
    decode_steps_total: int = 0
    preemptions_total: int = 0
    """Running batch sequences the scheduler sent back to their queue to make room for
    interactive ones (or to keep the batch small beside them)."""
    failure_requeues_total: int = 0
    """Sequences a failed step sent back to their queues, to be recomputed (`Engine._recover`):
    the cost of a failure, not a preemption."""
    isolated_failures_total: int = 0
    """Sequences failed alone because a step failed again when it admitted them with no other,
    after a failed step had requeued them (`Engine._recover`)."""
    requests_total: dict[str, int] = field(default_factory=lambda: {"stop": 0, "length": 0, "abort": 0, "error": 0})
    swaps_total: int = 0
    swap_pause_seconds_sum: float = 0.0
    swap_pause_seconds_last: float = 0.0
    swap_pauses: deque[float] = field(default_factory=lambda: deque(maxlen=1000))
    graph_captures_total: int = 0
    """CUDA graphs captured for decode (one per batch bucket and attended length in use)."""
    graph_capture_seconds_sum: float = 0.0
    """Seconds spent capturing them (warm-up run included), paused in the steps that did."""
    _recent: deque[tuple[float, int]] = field(default_factory=deque)

    def record_tokens(self, count: int) -> None:
        now = time.monotonic()
        self.generation_tokens_total += count
        self._recent.append((now, count))
        while self._recent and self._recent[0][0] < now - TOKENS_PER_S_WINDOW:
            self._recent.popleft()

    def record_swap(self, version: int, seconds: float) -> None:
        self.weight_version = version
        self.swaps_total += 1
        self.swap_pause_seconds_sum += seconds
        self.swap_pause_seconds_last = seconds
        self.swap_pauses.append(seconds)

    def record_capture(self, seconds: float) -> None:
        self.graph_captures_total += 1
        self.graph_capture_seconds_sum += seconds

    def tokens_per_s(self) -> float:
        """Generated tokens per second over the last few seconds."""
        now = time.monotonic()
        recent = list(self._recent)
        count = sum(n for t, n in recent if t >= now - TOKENS_PER_S_WINDOW)
        return count / TOKENS_PER_S_WINDOW


def render_prometheus(
    stats: EngineStats,
    model_name: str,
    weights: WeightsReport | None = None,
    keep_failures: int | None = None,
    queue_limit: int | None = None,
    queue_full_total: int | None = None,
) -> str:
    """The metrics; `weights` for a server following a weight store, `keep_failures` for one
    keeping its responses for feedback (`Capture.failures`), `queue_limit` and
    `queue_full_total` for the HTTP server's bound on waiting sequences (`Backlog`)."""
    label = f'model="{model_name}"'
    lines: list[str] = []

    def metric(name: str, kind: str, help_text: str, samples: list[tuple[str, float]]) -> None:
        lines.append(f"# HELP whetstone_{name} {help_text}")
        lines.append(f"# TYPE whetstone_{name} {kind}")
        for labels, value in samples:
            lines.append(f"whetstone_{name}{{{label}{labels}}} {value}")

    metric(
        "queue_depth",
        "gauge",
        "Requests waiting for a slot, by priority.",
        [(',priority="interactive"', stats.waiting_interactive), (',priority="batch"', stats.waiting_batch)],
    )
    if queue_limit is not None:
        metric(
            "queue_limit",
            "gauge",
            "Most sequences that may wait for a slot (max_waiting_sequences; 0 = no bound).",
            [("", queue_limit)],
        )
    if queue_full_total is not None:
        metric(
            "requests_refused_total",
            "counter",
            "Requests refused with 429 because the queue had no room for their sequences.",
            [(',reason="queue_full"', queue_full_total)],
        )
    metric("running_sequences", "gauge", "Sequences in the decode batch.", [("", stats.running)])
    metric(
        "tokens_per_second",
        "gauge",
        f"Generated tokens per second over the last {TOKENS_PER_S_WINDOW:g} s.",
        [("", round(stats.tokens_per_s(), 3))],
    )
    metric("generation_tokens_total", "counter", "Tokens generated.", [("", stats.generation_tokens_total)])
    metric("prompt_tokens_total", "counter", "Prompt tokens prefilled.", [("", stats.prompt_tokens_total)])
    metric(
        "prompt_tokens_shared_total",
        "counter",
        "Prompt tokens whose keys and values were copied from a running or recently finished sequence "
        "instead of prefilled.",
        [("", stats.prompt_tokens_shared_total)],
    )
    metric("decode_steps_total", "counter", "Batched decode steps.", [("", stats.decode_steps_total)])
    metric(
        "requests_total",
        "counter",
        "Finished sequences by finish reason.",
        [(f',reason="{reason}"', count) for reason, count in stats.requests_total.items()],
    )
    metric(
        "preemptions_total",
        "counter",
        "Batch sequences preempted for interactive ones.",
        [("", stats.preemptions_total)],
    )
    metric(
        "failure_requeues_total",
        "counter",
        "Sequences requeued to be recomputed because an engine step failed (a forward out of memory, say).",
        [("", stats.failure_requeues_total)],
    )
    metric(
        "isolated_failures_total",
        "counter",
        "Sequences failed alone because an engine step failed again when it admitted them with no other "
        "(a prompt too long for memory, say), after a failed step had requeued them.",
        [("", stats.isolated_failures_total)],
    )
    metric("weight_version", "gauge", "Weight version being served.", [("", stats.weight_version)])
    pauses = sorted(stats.swap_pauses)
    lines.append("# HELP whetstone_swap_pause_seconds Decode pause while new weights are written in place.")
    lines.append("# TYPE whetstone_swap_pause_seconds summary")
    for q in (0.5, 0.99):
        value = pauses[min(len(pauses) - 1, int(q * len(pauses)))] if pauses else float("nan")
        lines.append(f'whetstone_swap_pause_seconds{{{label},quantile="{q}"}} {value}')
    lines.append(f"whetstone_swap_pause_seconds_sum{{{label}}} {stats.swap_pause_seconds_sum}")
    lines.append(f"whetstone_swap_pause_seconds_count{{{label}}} {stats.swaps_total}")
    metric(
        "swap_pause_seconds_last",
        "gauge",
        "Decode pause of the last weight swap.",
        [("", stats.swap_pause_seconds_last)],
    )
    metric("graph_captures_total", "counter", "CUDA graphs captured for decode.", [("", stats.graph_captures_total)])
    metric(
        "graph_capture_seconds_sum",
        "counter",
        "Seconds spent capturing decode CUDA graphs.",
        [("", round(stats.graph_capture_seconds_sum, 6))],
    )
    if weights is not None:
        if weights.latest_version is not None:
            metric(
                "weight_version_latest", "gauge", "Newest weight version in the store.", [("", weights.latest_version)]
            )
        metric(
            "weights_stale",
            "gauge",
            "1 while the server cannot take the newest weight version.",
            [("", int(weights.problem is not None))],
        )
        metric(
            "weight_versions_rejected_total",
            "counter",
            "Weight versions rejected (corrupt, wrong base) or refused by the engine.",
            [("", weights.rejections_total)],
        )
        metric(
            "weight_version_rejected",
            "gauge",
            "Rejected weight versions newer than the one served.",
            [(f',version="{version}"', 1) for version in sorted(weights.rejected)],
        )
    if keep_failures is not None:
        metric(
            "feedback_keep_failures_total",
            "counter",
            "Responses whose answer went out unstored for feedback: the write failed or outlasted "
            "feedback.keep_timeout_s.",
            [("", keep_failures)],
        )
    return "\n".join(lines) + "\n"
