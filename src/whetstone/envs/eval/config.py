"""The config of `whetstone eval`: which endpoint, which tasks, how many samples, where the report goes."""

from __future__ import annotations

from pydantic import Field, field_validator, model_validator

from whetstone.config import Config
from whetstone.envs.harness.config import ApiRoot, EndpointConfig, HarnessConfig, RolloutConfig
from whetstone.envs.tasks.registry import TasksConfig
from whetstone.envs.tasks.synth import SynthConfig


class EvalConfig(Config):
    """Evaluate a served model on a task set."""

    endpoint: EndpointConfig = EndpointConfig()
    """The OpenAI-compatible server to evaluate (with `servers`: the request settings they share)."""
    servers: list[ApiRoot] = []
    """API roots of several servers of the same model to spread the rollouts over (least-loaded
    first; one that dies is taken out and its calls re-run elsewhere); empty = `endpoint.base_url`."""
    harness: HarnessConfig = HarnessConfig()
    """The agent loop (set `tokenizer_path` to the served model's folder)."""
    rollout: RolloutConfig = RolloutConfig()
    """Concurrency, sandboxes and grading."""
    tasks: TasksConfig = TasksConfig(synth=SynthConfig(split="heldout", count=50))
    """The task set (default: 50 held-out synth tasks)."""
    validate_tasks: bool = True
    """Use only tasks whose reference passes and whose starting repository fails (two graded runs
    each, cached by `tasks.validation_cache`)."""
    samples: int = Field(4, ge=1)
    """Rollouts per task."""
    k: list[int] = [1, 4]
    """The k of each pass@k reported (each at most `samples`)."""
    temperatures: list[float] = []
    """Sampling temperatures to evaluate besides the harness's own (`harness.sampling.temperature`,
    whose figures stay the report's headline): every task runs `samples` times at each, on the
    same seeds, and the report's `temperatures` gives pass@k at each (envs/eval/sweep.py). Empty =
    the harness's temperature only."""
    seed: int = Field(0, ge=-1)
    """Sampling seeds: rollout j of a task samples from seeds derived from (seed, task id, j), the
    same under any weights, so evaluations of two versions (before and after RL) are paired on
    common random numbers and their difference is far less noisy; -1 = unseeded."""
    output_dir: str = "runs/eval"
    """Where report.json, report.md and trajectories.jsonl are written."""
    save_trajectories: bool = True
    """Write every rollout's trajectory (tokens, logprobs, routes) to trajectories.jsonl."""

    @model_validator(mode="after")
    def _k_within_samples(self) -> EvalConfig:
        bad = [k for k in self.k if not 1 <= k <= self.samples]
        if bad or not self.k:
            raise ValueError(f"k={self.k}: each k must be between 1 and samples={self.samples}")
        return self

    @field_validator("temperatures")
    @classmethod
    def _temperatures_not_negative(cls, temperatures: list[float]) -> list[float]:
        if any(t < 0 for t in temperatures):
            raise ValueError(f"{temperatures}: a sampling temperature must be >= 0 (0 = greedy)")
        return temperatures

    @property
    def evaluated_temperatures(self) -> list[float]:
        """The harness's temperature (the headline), then each other one of `temperatures` once."""
        headline = self.harness.sampling.temperature
        return [headline, *(t for t in dict.fromkeys(self.temperatures) if t != headline)]
