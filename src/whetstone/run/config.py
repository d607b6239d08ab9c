"""The `whetstone run` config: its defaults are the embedded default of DESIGN.md."""

from __future__ import annotations

from pydantic import Field

from whetstone.config import Config
from whetstone.envs.tasks.synth import SynthConfig
from whetstone.midtrain.config import MidtrainConfig


class PipelineConfig(Config):
    """`whetstone run`: every stage of a run, written under `<output_dir>/<name>/`."""

    name: str = Field("default", min_length=1, pattern=r"^[A-Za-z0-9_.-]+$")
    """Run name: outputs go to `<output_dir>/<name>/`."""
    output_dir: str = "runs"
    """Parent directory of run folders."""
    demos: SynthConfig = SynthConfig(count=2000, split="train")
    """Synth train tasks whose solved transcripts are mixed into mid-training (train split only)."""
    midtrain: MidtrainConfig = MidtrainConfig()
    """Stage 1: mid-training on the code corpus plus the demonstrations."""
