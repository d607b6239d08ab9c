"""Everything the trainer needs before its first step: model, optimizer, stores, resumed state.

Resume: the newest checkpoint restores weights, optimizer, RNG and the next batch index c. The
weight store may be ahead of it (the trainer publishes every step, checkpoints every K): steps
c .. latest-1 are then *replayed* from the batch store, deterministically and without publishing,
so the trainer's state catches up with what the inference servers already hold. Every batch
thus shapes the weights exactly once, and every version is published exactly once.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from whetstone.errors import CheckpointError
from whetstone.midtrain.checkpoint import TrainState, latest_checkpoint, load_checkpoint
from whetstone.midtrain.optim import build_optimizer
from whetstone.model import Transformer
from whetstone.model.hf import load_hf
from whetstone.store import ObjectStore, open_store
from whetstone.sync import Publisher, WeightStore
from whetstone.trainer.config import TrainerConfig
from whetstone.utils.runtime import set_threads


@dataclass
class TrainerSession:
    config: TrainerConfig
    model: Transformer
    optimizer: torch.optim.AdamW
    reference: Transformer | None
    """Frozen initial policy for the KL term (only when loss.kl_coef > 0)."""
    batches: ObjectStore
    weights: WeightStore
    publisher: Publisher
    state: TrainState
    """`state.step` = optimizer steps taken = index of the next batch = the version the weights are."""
    replay_until: int
    """Steps below this were already published (by an earlier process): replay them silently."""
    resumed_from: Path | None

    @property
    def run_dir(self) -> Path:
        return Path(self.config.output_dir).expanduser()

    @property
    def checkpoints(self) -> Path:
        return self.run_dir / "checkpoints"


def open_trainer(config: TrainerConfig) -> TrainerSession:
    set_threads(config.threads)
    model = load_hf(config.model_path)
    opt = config.optimizer
    optimizer = build_optimizer(model, lr=opt.lr, betas=opt.betas, eps=opt.eps, weight_decay=opt.weight_decay)
    reference = None
    if config.loss.kl_coef > 0:
        reference = load_hf(config.model_path).eval().requires_grad_(False)

    run_dir = Path(config.output_dir).expanduser()
    resumed_from = latest_checkpoint(run_dir / "checkpoints")
    state = TrainState(step=0, data={"next_batch": 0})
    if resumed_from is not None:
        state = load_checkpoint(resumed_from, model, optimizer)

    weights = WeightStore.open(config.sync)
    publisher = Publisher(weights, config.sync)
    latest = weights.latest()
    if latest is None:
        if state.step > 0:
            raise CheckpointError(
                f"checkpoint {resumed_from} is at step {state.step}, but the weight store {config.sync.store} "
                "is empty: point sync.store at the run's store, or start a new output_dir"
            )
        publisher.publish(model.state_dict(), full=True)  # version 0: the initial weights
        latest = 0
    elif latest < state.step:
        raise CheckpointError(
            f"checkpoint {resumed_from} is at step {state.step}, but the weight store {config.sync.store} "
            f"only reaches version {latest}: not this run's store"
        )
    else:
        publisher.resume()  # continue the delta chain from what the servers hold
    batches = open_store(config.batch_store, endpoint_url=config.batch_store_endpoint_url)
    return TrainerSession(config, model, optimizer, reference, batches, weights, publisher, state,
                          replay_until=latest, resumed_from=resumed_from)
