"""The stages of `whetstone run`, one after the other, each resumable on its own.

Stage 1 (mid-training) is in place; the RL stages (servers, trainer, orchestrator, evaluation
before and after, report) join it as they land (issue: asynchronous RL).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from whetstone.config import dump_toml
from whetstone.errors import ConfigError
from whetstone.run.config import PipelineConfig
from whetstone.utils.atomic import atomic_write_json, atomic_write_text


def demo_source(config: PipelineConfig):
    """Transcripts of solved synth train tasks, generated only when the corpus is (re)built."""
    if config.demos.split != "train":
        raise ConfigError("demos.split must be 'train': held-out tasks never enter mid-training")

    def transcripts():
        from whetstone.envs.tasks.demonstrations import demonstrations
        from whetstone.envs.tasks.synth import generate

        return demonstrations(generate(config.demos))

    return transcripts if config.demos.count else None


def run_pipeline(config: PipelineConfig) -> dict[str, Any]:
    from whetstone.midtrain.cli import run_midtrain

    run_dir = Path(config.output_dir) / config.name
    run_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_text(run_dir / "config.toml", dump_toml(config))
    started = time.time()
    midtrain = config.midtrain.model_copy(deep=True)
    midtrain.run.output_dir, midtrain.run.name = str(run_dir), "midtrain"
    stages = {"midtrain": run_midtrain(midtrain, demos=demo_source(config))}
    summary = {"run_dir": str(run_dir), "wall_s": time.time() - started, "stages": stages,
               "config": config.model_dump(mode="json")}  # fmt: skip
    atomic_write_json(run_dir / "summary.json", summary)
    return summary
