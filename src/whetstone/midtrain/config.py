"""The mid-training config. Its defaults are the embedded default run (see docs/midtrain.md):
a tiny MoE trained from scratch on the built-in code corpus, on 2 CPU cores, in under 5 minutes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from whetstone.config import Config, FolderName, expand_path
from whetstone.data import CorpusConfig
from whetstone.model import ModelConfig
from whetstone.training.config import OptimizerConfig
from whetstone.utils.device import DeviceName
from whetstone.utils.tracking import TrackingConfig


class RunConfig(Config):
    """Where the run writes, how long it trains, and how it uses the machine."""

    name: FolderName = "midtrain"
    """Run name: outputs go to `<output_dir>/<name>/`."""
    output_dir: str = "runs"
    """Parent directory of run folders."""
    init_from: str = ""
    """A Hugging Face checkpoint folder (Qwen3 / Qwen3-MoE) to continue training from, with its
    tokenizer; empty = train the `model` section from scratch with the corpus's own tokenizer."""
    seed: int = Field(0, ge=0)
    """Seed for model initialisation and data order."""
    threads: int = Field(2, ge=0)
    """Torch intra-op threads for this process (0 = every core it may run on)."""

    device: DeviceName = "auto"
    """Where the model, its optimizer state and the batches are: `auto` (CUDA when present, else
    the CPU), `cpu`, `cuda` or `cuda:N`."""
    dtype: Literal["auto", "bfloat16", "float32"] = "auto"
    """Compute dtype: `bfloat16` under autocast, or `float32`; `auto` = bfloat16 on a GPU that has
    it and on a CPU that multiplies bf16 natively (AVX512-BF16 or AMX), float32 elsewhere (there
    bf16 matmuls run ~25x slower). Master weights and optimizer state are fp32 either way. On an
    AVX512-BF16 CPU a step of the embedded run's model takes 58-62 ms in bf16 against 81-92 in
    fp32 (docs/midtrain.md)."""
    activation_checkpointing: bool = False
    """Recompute each transformer block's activations in the backward pass instead of keeping
    them: less memory for longer rows or bigger batches, at about one more forward per step."""

    steps: int = Field(700, ge=1)
    """Optimizer steps of the whole run (the schedule's length)."""
    batch_size: int = Field(4, ge=1)
    """Sequences per micro-batch."""
    grad_accum: int = Field(1, ge=1)
    """Micro-batches per optimizer step (tokens per step = batch_size * grad_accum * seq_len)."""
    eval_interval: int = Field(100, ge=1)
    """Compute the validation loss every this many steps (and after the last step)."""
    eval_batches: int = Field(16, ge=1)
    """Validation micro-batches per evaluation (always the same ones)."""
    checkpoint_interval: int = Field(350, ge=1)
    """Write a checkpoint every this many steps (and after the last step)."""
    keep_checkpoints: int = Field(2, ge=1)
    """How many of the newest checkpoints to keep."""
    max_wall_time: float = Field(240, ge=0)
    """Seconds (from the start of the command, corpus build included) after which the run
    checkpoints, evaluates, exports and stops early; running it again continues. 0 = no limit."""
    resume: bool = True
    """Continue from the newest checkpoint in the run folder if there is one; false starts afresh,
    moving what an earlier run left there into `previous/<time>/`."""

    @property
    def run_dir(self) -> Path:
        """The run folder, `<output_dir>/<name>` (`~` and `$NAME` expanded: `expand_path`)."""
        return expand_path(self.output_dir) / self.name


class MidtrainModelConfig(ModelConfig):
    """`ModelConfig` with the embedded default's sizes as its defaults, so a partial model section
    (`--set model.hidden_size=256`) changes only what it names.

    ModelConfig's MoE (8 experts, top-2, 4 query / 2 KV heads), shallower and narrower, with an
    untied head. Measured on the 2 shared cores (docs/midtrain.md): per unit of compute it ends
    lower than `ModelConfig()` (2 layers learn faster per step early on and cost a third per
    token), and untying the head shortens the plateau at the unigram loss.
    """

    hidden_size: int = 128
    """Width of the residual stream."""
    num_hidden_layers: int = 2
    """Number of transformer blocks."""
    head_dim: int = 32
    """Width of one attention head."""
    moe_intermediate_size: int = 128
    """Hidden width of one routed expert's SwiGLU MLP."""
    tie_word_embeddings: bool = False
    """Share the embedding matrix with the output head."""


class MidtrainConfig(Config):
    """`whetstone midtrain`: next-token training of the model on the code corpus."""

    model: MidtrainModelConfig = MidtrainModelConfig()
    """The model to train (architecture and sizes). With `run.init_from` the checkpoint's
    config.json gives it, and any field set here must agree with it."""
    data: CorpusConfig = CorpusConfig()
    """The corpus, tokenizer and sequence length."""
    optimizer: OptimizerConfig = OptimizerConfig()
    """AdamW, learning-rate schedule, gradient clipping."""
    run: RunConfig = RunConfig()
    """Output, length, batch and machine settings."""
    tracking: TrackingConfig = TrackingConfig()
    """Where the metrics go besides metrics.jsonl: TensorBoard (on), Weights & Biases (off)."""

    @field_validator("model", mode="before")
    @classmethod
    def _accept_any_model_config(cls, value: Any) -> Any:
        """A plain `ModelConfig` is taken field for field (its own defaults included)."""
        if isinstance(value, ModelConfig) and not isinstance(value, MidtrainModelConfig):
            return value.model_dump()
        return value

    @model_validator(mode="after")
    def _warmup_fits(self) -> "MidtrainConfig":
        if self.optimizer.warmup_steps >= self.run.steps:
            raise ValueError(
                f"optimizer.warmup_steps ({self.optimizer.warmup_steps}) must be below run.steps ({self.run.steps})"
            )
        return self
