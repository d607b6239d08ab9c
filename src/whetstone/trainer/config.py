"""The trainer's config. Defaults serve the embedded default run: the mid-trained tiny MoE, batches
and weights in local directories under `runs/default/`, router replay on, a checkpoint every 10 steps.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from whetstone.config import Config
from whetstone.rl.loss import LossConfig
from whetstone.sync.config import SyncConfig, check_unrounded_for_invariant
from whetstone.training.config import OptimizerConfig
from whetstone.utils.device import DeviceName
from whetstone.utils.tracking import TrackingConfig


class TrainerConfig(Config):
    """`whetstone trainer`: consume batch n, take optimizer step n, publish weight version n + 1."""

    model_path: str = "runs/default/midtrain/model"
    """Hugging Face folder of the initial policy (what mid-training exported); also the KL reference."""
    batch_store: str = "runs/default/batches"
    """Where the orchestrator puts batches (`batches/<n:010d>.batch`): a directory or s3://bucket/prefix."""
    batch_store_endpoint_url: str | None = None
    """S3 endpoint of the batch store for non-AWS object stores (MinIO, R2, moto)."""
    output_dir: str = "runs/default/trainer"
    """The trainer's own folder: config.toml, metrics.jsonl, checkpoints/."""
    sync: SyncConfig = SyncConfig()
    """The weight store every step is published to (the inference servers follow the same one)."""
    loss: LossConfig = LossConfig()
    """Clipping, truncated importance sampling, ratio masking, KL to the reference."""
    optimizer: OptimizerConfig = OptimizerConfig(lr=2e-4, warmup_steps=0, min_lr_ratio=1.0, weight_decay=0.0)
    """AdamW and gradient clipping. RL runs have no natural end, so the default learning rate is
    constant (min_lr_ratio 1); `warmup_steps` ramps it up linearly."""
    logit_scale_lr: float = Field(0.0, ge=0.0)
    """Learning rate of a learned global sharpness: Adam on the log-scale of the logits, folded
    into the final norm's gains after every optimizer step (`rl.logit_scale`); 0 = off. RL at small
    scale mostly has to sharpen the policy, which the per-token pushes do slowly (docs/run.md)."""
    demos_path: str = ""
    """JSONL of demonstration transcripts (`{"messages": [...]}` per line, `rl.demos`) for the
    behaviour-cloning anchor; needed when `demo_coef` > 0. `whetstone run` fills it with its
    mid-training demonstrations."""
    demo_coef: float = Field(0.0, ge=0.0)
    """Weight of the anchor: every optimizer step adds this times the mean next-token loss of
    `demo_rows` demonstrations (on the assistant's tokens, at the logits before the learned
    scale) to the policy loss, so RL does not unlearn what it never samples; 0 = off."""
    demo_rows: int = Field(8, ge=1)
    """Demonstrations per optimizer step, drawn anew each step."""
    demo_max_positions: int = Field(1024, ge=0)
    """Skip demonstrations longer than this many positions (0 = keep all)."""
    router_replay: bool = True
    """Replay the rollout's routes in the forward and backward passes (MoE models with routes in
    the batch); off = the trainer routes on its own, and the disagreement with the rollout is logged."""
    micro_batch_size: int = Field(4, ge=1)
    """Rows per forward/backward, taken in order of length (less padding); the step's gradient is
    the same for any value (the loss is normalised over the whole step), except with
    `loss.forking_fraction` < 1, whose entropy threshold is taken per micro-batch."""
    device: DeviceName = "auto"
    """Where the policy, its optimizer state, the reference and the batches are: `auto` (CUDA when
    present, else the CPU), `cpu`, `cuda` or `cuda:N`; under torchrun each rank takes the GPU of
    its LOCAL_RANK."""
    activation_checkpointing: bool = False
    """Recompute each transformer block's activations in the backward pass instead of keeping
    them: less memory for longer rows or bigger micro-batches, at about one more forward per step."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Compute dtype (bf16 under autocast); master weights and optimizer state are always fp32.
    fp32 keeps the trainer's logprobs closest to an fp32 inference engine's."""
    numerics: Literal["fast", "invariant"] = "fast"
    """`invariant`: batch-invariant kernels in the forward; with inference servers on the same
    `numerics` and `dtype`, the trainer's logprobs and router choices equal the rollout's bit for
    bit (importance ratio exactly 1 at staleness 0; docs/consistency.md, with its cost). Needs
    `sync.publish_dtype = "float32"` (or `"autocast"` in bf16), so the servers hold the weights
    the trainer computes with unrounded."""
    optimizer_steps_per_batch: int = Field(1, ge=1)
    """PPO-style mini-batches: each batch's rows are shuffled and split into this many parts, one
    optimizer step each, then one weight version is published (rows without a trained token are
    left out of the parts). Later parts train a policy that has moved since sampling; the clip and
    the importance ratio bound how far."""
    threads: int = Field(1, ge=0)
    """Torch intra-op threads of this process (0 = every core it may run on)."""
    max_steps: int = Field(0, ge=0)
    """Stop after this many optimizer steps in total (batches 0 .. max_steps-1); 0 = run until stopped."""
    idle_timeout: float = Field(0.0, ge=0)
    """Stop (after a checkpoint) when no new batch arrived for this many seconds; 0 = wait forever."""
    poll_interval: float = Field(0.2, gt=0, allow_inf_nan=False)
    """Seconds between checks of the batch store while waiting for the next batch."""
    checkpoint_interval: int = Field(10, ge=1)
    """Checkpoint every this many steps (and when stopping). Steps after the last checkpoint are
    replayed from the batch store on restart, so the store must keep batches since then."""
    keep_checkpoints: int = Field(2, ge=1)
    """How many of the newest checkpoints to keep."""
    publish_in_background: bool = True
    """Encode and upload weight version n + 1 on a worker thread while step n + 1 trains (the
    weights are copied first); off: each step waits for its own publish."""
    tracking: TrackingConfig = TrackingConfig()
    """Where the metrics go besides metrics.jsonl: TensorBoard (on), Weights & Biases (off)."""

    @model_validator(mode="after")
    def _schedule_has_a_length(self) -> "TrainerConfig":
        if self.optimizer.min_lr_ratio < 1 and self.max_steps == 0:
            raise ValueError("optimizer.min_lr_ratio < 1 decays the learning rate over max_steps: set max_steps")
        if self.max_steps and self.optimizer.warmup_steps > self.max_steps:
            raise ValueError(
                f"optimizer.warmup_steps ({self.optimizer.warmup_steps}) is more than max_steps ({self.max_steps}): "
                "the learning rate would never reach optimizer.lr"
            )
        return self

    @model_validator(mode="after")
    def _invariant_servers_hold_these_weights(self) -> "TrainerConfig":
        check_unrounded_for_invariant(self.numerics, self.sync, self.dtype)
        return self
