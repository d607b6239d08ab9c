"""The deploy gate: a candidate is scored on held-out tasks and published only if it does not
regress beyond a threshold (Composer: every model is gated by an offline benchmark).

The candidate answers through an inference `Engine` of its own in this process, with the weights
exactly as the servers would receive them (the published dtype, written by the same hot-swap
path) and with the loop's numerics and compute dtype (the servers' own, docs/online.md), so
what is scored is what would be deployed. Each (task, sample) has a fixed seed: two versions are
compared on the same random numbers.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from whetstone.envs.tasks.registry import load_tasks
from whetstone.errors import ConfigError, WhetstoneError
from whetstone.inference.config import EngineConfig
from whetstone.inference.engine import Engine
from whetstone.inference.sampling import InvalidRequest, SamplingParams
from whetstone.inference.swap import full_update
from whetstone.model import Numerics, Transformer
from whetstone.online.config import GateConfig
from whetstone.online.preferences import make_preference, task_messages
from whetstone.tokenizer import Tokenizer, render_chat

MAX_EVAL_BATCH = 16
SCORE_ROUNDING = 1e-9
"""Slack in the gate's comparisons: a drop of exactly the allowed regression (0.55 - 0.05 against
0.5) passes, whatever the floating-point rounding of the scores (fractions of answers)."""


@dataclass
class Verdict:
    publish: bool
    reason: str


class Gate:
    def __init__(
        self,
        config: GateConfig,
        model: Transformer,
        tokenizer: Tokenizer,
        numerics: Numerics = "fast",
        dtype: str = "float32",
        device: str = "auto",
    ):
        """`model`: a model of the served architecture for the evaluation engine (its weights are
        overwritten before every score). `numerics`, `dtype`: the engine's, as the servers run;
        `device` its device."""
        self.config = config
        self.tasks = load_tasks(config.tasks)
        if not self.tasks:
            raise ConfigError(f"gate.tasks: the source {config.tasks.source!r} gave no tasks")
        self.preference = make_preference(config.metric)
        self.prompts = [tokenizer.encode(render_chat(task_messages(t), add_generation_prompt=True)) for t in self.tasks]
        batch = min(MAX_EVAL_BATCH, len(self.prompts) * config.samples)
        engine = EngineConfig(max_batch=batch, numerics=numerics, dtype=dtype, device=device)
        self.engine = Engine(
            model, engine, eos_token_ids=(tokenizer.im_end_id, tokenizer.endoftext_id), decode=tokenizer.decode
        )
        for task, prompt in zip(self.tasks, self.prompts):
            try:
                self.engine.check_request(prompt, self._params(0))
            except InvalidRequest as err:
                raise ConfigError(f"gate: task {task.id} does not fit the model: {err}") from None

    def _params(self, seed: int) -> SamplingParams:
        return SamplingParams(max_tokens=self.config.max_tokens, temperature=self.config.temperature, seed=seed)

    def replies(self, weights: dict[str, torch.Tensor], version: int) -> list[str]:
        """The replies of `weights` (as published) to every (task, sample), task by task. Raises
        a WhetstoneError if the engine could not write them: the replies would be another
        version's, and its score that version's verdict."""
        update = self.engine.update_weights(full_update(weights, version))
        prompts = [p for p in self.prompts for _ in range(self.config.samples)]
        params = [self._params(seed) for seed in range(len(prompts))]
        replies = [seq.text.text for seq in self.engine.generate(prompts, params)]  # written at its first step
        if not update.done.is_set() or update.error is not None:
            why = update.error or "not written"
            raise WhetstoneError(f"the gate's engine could not take weight version {version} to score it: {why}")
        return replies

    def score(self, weights: dict[str, torch.Tensor], version: int) -> float:
        """Fraction of the held-out replies the metric likes."""
        replies = self.replies(weights, version)
        tasks = [t for t in self.tasks for _ in range(self.config.samples)]
        with ThreadPoolExecutor(self.config.workers) as pool:
            liked = list(pool.map(self.preference.likes, tasks, replies))
        return sum(liked) / len(liked)

    def verdict(self, candidate: float, deployed: float, start: float) -> Verdict:
        config = self.config
        if deployed - candidate > config.max_regression + SCORE_ROUNDING:
            return Verdict(
                False,
                f"held-out score {candidate:.3f} is below the deployed version's {deployed:.3f} "
                f"by more than gate.max_regression = {config.max_regression}",
            )
        if start - candidate > config.max_total_regression + SCORE_ROUNDING:
            return Verdict(
                False,
                f"held-out score {candidate:.3f} is below the starting version's {start:.3f} "
                f"by more than gate.max_total_regression = {config.max_total_regression}",
            )
        return Verdict(True, f"held-out score {candidate:.3f} (deployed {deployed:.3f}, start {start:.3f})")
