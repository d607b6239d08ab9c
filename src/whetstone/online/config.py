"""The config of `whetstone online` (the servers' `[feedback]` section is in `inference.feedback`).

Defaults serve the embedded default: after `whetstone run`, servers that follow the run's weight
store and keep their users' responses in `runs/default/feedback.db` (SQLite), and an online loop
that continues the run's weight store from its newest version.
"""

from __future__ import annotations

import re
from typing import Literal, get_args

from pydantic import Field, model_validator

from whetstone.config import Config
from whetstone.envs.tasks.registry import TasksConfig
from whetstone.envs.tasks.synth import SynthConfig
from whetstone.errors import WhetstoneError
from whetstone.inference.feedback import Rating
from whetstone.rl.loss import LossConfig
from whetstone.rl.staleness import StalenessConfig
from whetstone.sync.config import SyncConfig, check_unrounded_for_invariant
from whetstone.training.config import OptimizerConfig
from whetstone.utils.device import DeviceName
from whetstone.utils.tracking import TrackingConfig


class RewardMapping(Config):
    """Feedback events -> rewards. Kept bounded on purpose: thumbs can teach sycophancy."""

    thumbs_up: float = 0.75
    """Reward of a thumbs up (Cursor Tab: +0.75 for an accepted suggestion)."""
    thumbs_down: float = -0.25
    """Reward of a thumbs down (Cursor Tab: -0.25 for a rejected one)."""
    edit_kept: float = 0.75
    """Reward when the user kept the suggested edit."""
    edit_reverted: float = -0.25
    """Reward when the user reverted it."""
    score_low: float = -0.25
    """Reward of a `score` of 0; a score s in [0, 1] gets score_low + s * (score_high - score_low)."""
    score_high: float = 0.75
    """Reward of a `score` of 1."""

    def reward(self, rating: str, score: float | None) -> float:
        """The reward of a feedback event. Raises WhetstoneError for an event the servers would
        have refused (another rating, a `score` rating without a score in [0, 1]): the feedback
        store takes what any writer gives it, and such an event has no reward here."""
        if rating not in get_args(Rating):
            raise WhetstoneError(f"rating {rating!r} is not one of {', '.join(get_args(Rating))}")
        if rating != "score":
            return getattr(self, rating)
        if score is None or not 0.0 <= score <= 1.0:  # NaN too
            raise WhetstoneError(f"rating 'score' needs a score from 0 to 1, not {score!r}")
        return self.score_low + float(score) * (self.score_high - self.score_low)


class TriggerConfig(Config):
    """When the loop takes an update."""

    every_events: int = Field(32, ge=1)
    """Update as soon as this many new feedback events arrived since the last update."""
    every_seconds: float = Field(3600.0, gt=0)
    """... or once this long passed since the last update, if at least `min_events` arrived."""
    min_events: int = Field(8, ge=1)
    """Fewest new events an interval update trains on."""
    max_events: int = Field(256, ge=1)
    """Most events one update reads (oldest first; the rest wait for the next update)."""

    @model_validator(mode="after")
    def _ordered(self) -> "TriggerConfig":
        if not self.min_events <= self.every_events <= self.max_events:
            raise ValueError(
                f"need min_events ({self.min_events}) <= every_events ({self.every_events}) "
                f"<= max_events ({self.max_events})"
            )
        return self


class PreferenceConfig(Config):
    """What a reply is judged by: the gate's held-out metric, or a simulated user's taste."""

    kind: Literal["passes_tests", "regex"] = "passes_tests"
    """`passes_tests`: the solution.py the reply writes (a write_file tool call) passes the task's
    hidden tests in a sandbox; `regex`: the reply text matches `pattern` (a style)."""
    pattern: str = ""
    """Regular expression for `regex` (Python `re.search` on the reply text)."""

    @model_validator(mode="after")
    def _pattern(self) -> "PreferenceConfig":
        if self.kind == "regex" and not self.pattern:
            raise ValueError("kind = 'regex' needs a pattern")
        try:
            re.compile(self.pattern)
        except re.error as err:
            raise ValueError(f"pattern {self.pattern!r} is not a regular expression: {err}") from None
        return self


class GateConfig(Config):
    """The evaluation every candidate passes before it is published."""

    tasks: TasksConfig = TasksConfig(synth=SynthConfig(split="heldout", count=24, seed=101))
    """Held-out tasks: their prompts (system prompt + task) are answered by the candidate."""
    metric: PreferenceConfig = PreferenceConfig()
    """How each answer is scored (default: its code passes the task's hidden tests)."""
    samples: int = Field(1, ge=1)
    """Answers per task."""
    temperature: float = Field(1.0, ge=0.0)
    """Sampling temperature of the answers: the one users are served at, since greedy answers can
    stay right while sampled ones get worse. Each answer has a fixed seed, so two versions are
    compared on the same random numbers."""
    max_tokens: int = Field(160, ge=1)
    """Completion budget of one answer."""
    max_regression: float = Field(0.05, ge=0.0)
    """Discard a candidate whose score is below the deployed version's by more than this."""
    max_total_regression: float = Field(0.1, ge=0.0)
    """... or below the score of the version the loop started from (or adopted) by more than
    this, so small accepted regressions cannot add up."""
    workers: int = Field(2, ge=1)
    """Answers scored at once (`passes_tests` runs each in its own sandbox)."""


class OnlineConfig(Config):
    """`whetstone online`: feedback on the deployed model -> a policy-gradient step -> a held-out
    gate -> publish (or discard, saying why), over and over."""

    model_path: str = "runs/default/midtrain/model"
    """Hugging Face folder of the served model (architecture, tokenizer; the weights of version 0
    when the weight store is empty)."""
    feedback_store: str = "runs/default/feedback.db"
    """The servers' feedback database (their `feedback.store`): a SQLite path or a PostgreSQL URL."""
    sync: SyncConfig = SyncConfig(keep_keyframes=10)
    """The weight store the servers follow; the loop continues from its newest version. Keeps more
    keyframes than the trainer's default, so rollback can reach further back."""
    output_dir: str = "runs/default/online"
    """The loop's folder: config.toml, metrics.jsonl (one record per update), state.json."""
    trigger: TriggerConfig = TriggerConfig()
    """When to take an update."""
    rewards: RewardMapping = RewardMapping()
    """Feedback event -> reward."""
    baseline: Literal["batch_mean", "none"] = "batch_mean"
    """Advantage = reward minus the mean reward of the update's samples (`batch_mean`), or the
    reward itself (`none`, Cursor Tab's +0.75 / -0.25 being roughly centered already)."""
    staleness: StalenessConfig = StalenessConfig(max_off_policy_steps=1)
    """Feedback on responses sampled with weights more than this many updates behind the deployed
    ones is dropped (0 = only the current weights, as Cursor Tab trains); a rollback's version
    holds an earlier version's weights, and counts as that version (docs/online.md)."""
    loss: LossConfig = LossConfig()
    """The RL trainer's loss: clipping, truncated importance sampling, KL to the starting weights."""
    optimizer: OptimizerConfig = OptimizerConfig(lr=1e-4, warmup_steps=0, min_lr_ratio=1.0, weight_decay=0.0)
    """AdamW at a constant learning rate (online RL has no end)."""
    logit_scale_lr: float = Field(0.1, ge=0.0)
    """Learning rate of the learned global sharpness (`rl.logit_scale`, as the RL trainer's
    `logit_scale_lr`): one Adam step on the log-scale of the logits per update; 0 = off. With 0.1,
    `whetstone bench online` moved the mid-trained model toward the users' taste, without it
    not (docs/online.md). One step per update, against the embedded RL run's four per batch
    (where 0.03 keeps its unclipped gradient from overshooting)."""
    router_replay: bool = True
    """Replay the served routes in the trainer's forward (MoE models)."""
    micro_batch_size: int = Field(8, ge=1)
    """Rows per forward/backward."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Compute dtype of the training forward and of the gate's engine (masters stay fp32): set it
    to the servers' `engine.dtype`."""
    numerics: Literal["fast", "invariant"] = "fast"
    """Kernels of the training forward and of the gate's engine: set it to the servers'
    `engine.numerics`. `invariant`: batch-invariant kernels; with the servers on them too (and
    the same dtype), the trainer's logprobs equal the served ones bit for bit (docs/consistency.md).
    Needs `sync.publish_dtype = "float32"` (or `"autocast"` in bf16), so the servers hold the
    weights the loop computes with unrounded."""
    gate: GateConfig = GateConfig()
    """Held-out evaluation of every candidate."""
    device: DeviceName = "auto"
    """Where the policy trains and the gate's engine runs: `auto` (CUDA when present, else the
    CPU), `cpu`, `cuda` or `cuda:N`."""
    threads: int = Field(1, ge=0)
    """Torch threads of the loop (0 = every core it may run on); the servers keep the rest."""
    nice: int = Field(10, ge=0, le=19)
    """CPU niceness `whetstone online` gives its process (and the gate's sandboxes): on shared
    cores, the servers answering users come first."""
    poll_interval: float = Field(1.0, gt=0, allow_inf_nan=False)
    """Seconds between checks of the feedback store."""
    feedback_retry_s: float = Field(300.0, ge=0)
    """How long the loop retries a failed read of the feedback store (backing off from 0.5 s to
    30 s between tries, logging each failure) before it stops with the error: a restarting
    database server, a lock held past its timeout; 0 = stop at the first failure."""
    retention_days: float = Field(7.0, ge=0)
    """Each update deletes responses older than this from the feedback store, once the loop has
    read their feedback (or they got none), with that feedback; 0 = keep everything. Feedback
    on a deleted response is refused as unknown (it would be long past the staleness bound)."""
    max_updates: int = Field(0, ge=0)
    """Stop once output_dir holds this many updates (published or discarded), those of earlier
    runs of the loop there included (a resumed loop goes on counting); 0 = run until stopped."""
    tracking: TrackingConfig = TrackingConfig()
    """Where the metrics go besides metrics.jsonl: TensorBoard (on), Weights & Biases (off)."""

    @model_validator(mode="after")
    def _invariant_servers_hold_these_weights(self) -> "OnlineConfig":
        check_unrounded_for_invariant(self.numerics, self.sync, self.dtype)
        return self
