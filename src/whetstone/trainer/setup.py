"""Everything the trainer needs before its first step: model, optimizer, stores, resumed state.

Resume: the newest checkpoint restores weights, optimizer, RNG and the next batch index c. The
weight store may be ahead of it (the trainer publishes every step, checkpoints every K): steps
c .. latest-1 are then *replayed* from the batch store, deterministically and without publishing,
so the trainer's state catches up with what the inference servers already hold. Every batch
thus shapes the weights exactly once, and every version is published exactly once.

Before any model work `output_dir` and its `checkpoints/` must be (or be creatable as) folders
this process can write, and `model_path`'s tokenizer must have no more ids than its model has
embedding rows (`check_vocab_fits`); temporary folders of saves that crashed are deleted. The
checkpoint is resumed only with the tokenizer it was trained with (`model_path`'s tokenizer.json:
demonstrations are tokenized with it, and the inference servers decode with it), and a damaged
one is refused naming the older complete ones (`naming_older_checkpoints`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch

from whetstone.config import expand_path
from whetstone.errors import CheckpointError, ConfigError, WhetstoneError
from whetstone.model import Transformer
from whetstone.model.hf import check_vocab_fits, load_hf, read_hf_config
from whetstone.model.layout import autocast_tables
from whetstone.rl.demos import load_demos
from whetstone.rl.logit_scale import LogitScale
from whetstone.rl.samples import Sample
from whetstone.store import ObjectStore, open_store
from whetstone.sync import Publisher, WeightStore
from whetstone.tokenizer import Tokenizer
from whetstone.trainer.config import TrainerConfig
from whetstone.training.checkpoint import (
    TOKENIZER_KEY,
    TrainState,
    check_tokenizer,
    checkpoint_step,
    latest_checkpoint,
    naming_older_checkpoints,
    read_state,
    remove_stale_temporaries,
    tokenizer_identity,
)
from whetstone.training.distributed import (
    broadcast,
    full_state_dict,
    load_sharded_checkpoint,
    on_rank_0,
    shard_model,
    world,
)
from whetstone.training.optim import optimizer_for
from whetstone.utils.atomic import writable_folder_problem
from whetstone.utils.device import resolve_device, use_device
from whetstone.utils.runtime import configure_process

log = logging.getLogger("whetstone.trainer")


@dataclass
class TrainerSession:
    config: TrainerConfig
    model: Transformer
    """The policy; under torchrun, this rank's FSDP2 shards of it (`training.distributed`)."""
    optimizer: torch.optim.AdamW
    reference: Transformer | None
    """Frozen initial policy for the KL term (only when loss.kl_coef > 0)."""
    batches: ObjectStore
    weights: WeightStore | None
    """The weight store (rank 0 only: the one rank that publishes)."""
    publisher: Publisher | None
    state: TrainState
    """`state.step` = optimizer steps taken = index of the next batch = the version the weights are."""
    replay_until: int
    """Steps below this were already published (by an earlier process): replay them silently."""
    resumed_from: Path | None
    logit_scale: LogitScale | None = None
    """The learned sharpness (`config.logit_scale_lr` > 0); its state rides in `state.data`."""
    demos: list[Sample] | None = None
    """Demonstrations of the behaviour-cloning anchor (`config.demo_coef` > 0)."""
    rank: int = 0
    world_size: int = 1
    device: torch.device = torch.device("cpu")
    """Where the model, its optimizer state and the batches are (`config.device` resolved)."""

    @property
    def run_dir(self) -> Path:
        return expand_path(self.config.output_dir)

    @property
    def checkpoints(self) -> Path:
        return self.run_dir / "checkpoints"


def new_optimizer(config: TrainerConfig, model: torch.nn.Module) -> torch.optim.AdamW:
    """The configured AdamW over `model` (sharded or plain)."""
    opt = config.optimizer
    return optimizer_for(model, opt)


def start_over(config: TrainerConfig) -> str:
    """The advice to train from the start: everything a trainer goes on from is new (the
    batch store too: step n trains on its batch n, a new trainer's as well)."""
    return (
        f"start over with a new output_dir, weight store and batch store (not {config.output_dir}, "
        f"{config.sync.store} and {config.batch_store})"
    )


def check_max_steps(config: TrainerConfig, checkpoint: Path | None) -> None:
    """A `max_steps` below the step of the checkpoint the trainer resumes is refused: the trainer
    would take no step and end at the checkpoint's later step, and whoever waits for version
    `max_steps` (`whetstone run`) would wait for ever."""
    if checkpoint is None or not config.max_steps:
        return
    step = checkpoint_step(checkpoint)
    if step > config.max_steps:
        raise ConfigError(
            f"max_steps = {config.max_steps}, but the checkpoint {checkpoint} is already at step {step}: "
            f"raise max_steps to at least {step}, or {start_over(config)}"
        )


def check_store_is_the_runs(config: TrainerConfig, checkpoint: Path | None, step: int, latest: int | None) -> None:
    """Refuse a weight store whose newest version (`latest`, None: empty) cannot be this run's
    for a trainer resuming `checkpoint` at `step`, or that is already past `max_steps`."""
    if latest is None:
        if step > 0:
            raise CheckpointError(
                f"checkpoint {checkpoint} is at step {step}, but the weight store {config.sync.store} "
                f"is empty: point sync.store at the run's store, or {start_over(config)}"
            )
    elif latest < step:
        raise CheckpointError(
            f"checkpoint {checkpoint} is at step {step}, but the weight store {config.sync.store} "
            f"only reaches version {latest}: not this run's store"
        )
    elif config.max_steps and latest > config.max_steps:
        raise ConfigError(
            f"max_steps = {config.max_steps}, but the weight store {config.sync.store} already holds "
            f"version {latest}: the trainer would stop short of it. Raise max_steps to at least {latest}, "
            f"or {start_over(config)}"
        )


def open_trainer(config: TrainerConfig) -> TrainerSession:
    """Under torchrun (a process group is up), every rank calls this: the model is sharded, rank
    0 reads the checkpoint and owns the weight store, and every rank learns what rank 0 decided."""
    configure_process(config.threads)
    device = resolve_device(config.device)  # under torchrun: the GPU of this rank's LOCAL_RANK
    use_device(device)
    rank, world_size = world()
    run_dir = expand_path(config.output_dir)
    problem = None
    if rank == 0:  # the folders rank 0 writes, checked before a checkpoint interval is trained
        problem = writable_folder_problem(run_dir) or writable_folder_problem(run_dir / "checkpoints")
    if problem := broadcast(problem):
        raise ConfigError(f"{problem}: the trainer writes its checkpoints and metrics into output_dir {run_dir}")
    model_path = expand_path(config.model_path)
    if (model_path / "tokenizer.json").is_file():  # demonstrations are tokenized with it, servers decode with it
        check_vocab_fits(
            Tokenizer.load(model_path).vocab_size,
            str(model_path / "tokenizer.json"),
            read_hf_config(model_path).vocab_size,
            str(model_path / "config.json"),
        )
    demos = None
    if config.demo_coef > 0:  # read first: a bad file fails before any model work
        if not config.demos_path:
            raise ConfigError("demo_coef > 0 needs demos_path (a JSONL file of demonstration transcripts)")
        demos = load_demos(config.demos_path, Tokenizer.load(config.model_path), config.demo_max_positions)
    if rank == 0:
        for stale in remove_stale_temporaries(run_dir / "checkpoints"):
            log.warning("deleted %s, left by a checkpoint save that did not finish", stale)
    resumed_from = broadcast(latest_checkpoint(run_dir / "checkpoints"))  # rank 0's view
    check_max_steps(config, resumed_from)  # before any model work
    tokenizer = tokenizer_identity(expand_path(config.model_path))
    if resumed_from is not None:  # refused on every rank: the others would wait in the load's collective

        def check_resumable() -> None:
            with naming_older_checkpoints(resumed_from):
                recorded = read_state(resumed_from)
            trained_from = recorded.get("config", {}).get("model_path")
            check_tokenizer(
                resumed_from,
                recorded["data"],
                tokenizer,
                f"model_path {config.model_path}",
                f"Point model_path at the model the run started from (the checkpoint's: {trained_from}), "
                f"or {start_over(config)}",
            )

        on_rank_0(check_resumable, f"read checkpoint {resumed_from}")
    loaded = load_hf(config.model_path)
    tables = autocast_tables(loaded)  # before sharding: a tied head is still the table itself
    model = shard_model(loaded, device)
    model.activation_checkpointing = config.activation_checkpointing
    optimizer = new_optimizer(config, model)  # after the move: fused AdamW on CUDA
    reference = None
    if config.loss.kl_coef > 0:
        reference = shard_model(load_hf(config.model_path).eval().requires_grad_(False), device, frozen=True)

    state = TrainState(step=0, data={"next_batch": 0})
    if resumed_from is not None:
        state = load_sharded_checkpoint(resumed_from, model, optimizer, partial(new_optimizer, config))
    if tokenizer is not None:
        state.data[TOKENIZER_KEY] = tokenizer  # recorded in every checkpoint from here on

    logit_scale = None
    if config.logit_scale_lr > 0:
        opt = config.optimizer
        logit_scale = LogitScale(config.logit_scale_lr, beta1=opt.betas[0], beta2=opt.betas[1], eps=opt.eps)
        if "logit_scale" in state.data:
            logit_scale.load_state(state.data["logit_scale"])
    elif state.data.get("logit_scale"):
        raise CheckpointError(
            f"checkpoint {resumed_from} was trained with a learned logit scale "
            "(logit_scale_lr > 0); resume it with logit_scale_lr set"
        )

    def open_weights() -> tuple[WeightStore, int | None]:
        try:  # a resumed run's store exists: a missing one is refused, not created empty
            store = WeightStore.open(config.sync, create=resumed_from is None)
        except WhetstoneError as err:
            if resumed_from is None:
                raise
            raise CheckpointError(
                f"checkpoint {resumed_from} is at step {state.step}, but its weight store: {err}"
            ) from None
        # the head healing would leave, read without writing (a manifest written before a crash kept the
        # pointer is this run's newest, and its batches are replayed; a standing withdrawal's versions are
        # gone): another run's store is refused below untouched; this run's is healed by `publisher.resume`
        head = store.healed_head()
        return store, None if head is None else head.version

    # rank 0 alone owns the store; its failure is every rank's (`on_rank_0`)
    weights, latest = on_rank_0(open_weights, f"open the weight store {config.sync.store}") or (None, None)
    latest = broadcast(latest)
    check_store_is_the_runs(config, resumed_from, state.step, latest)  # on every rank: all refuse together
    initial = full_state_dict(model) if latest is None else None  # gathered by every rank

    def start_publishing() -> Publisher:
        publisher = Publisher(weights, config.sync, tables)
        if latest is None:
            publisher.publish(initial, full=True)  # version 0: the initial weights
        else:
            publisher.resume()  # continue the delta chain from what the servers hold
        return publisher

    publishing = (
        "publish version 0, the initial weights," if latest is None else f"resume publishing after version {latest}"
    )
    publisher = on_rank_0(start_publishing, f"{publishing} in the weight store {config.sync.store}")
    batches = open_store(config.batch_store, endpoint_url=config.batch_store_endpoint_url)
    return TrainerSession(
        config,
        model,
        optimizer,
        reference,
        batches,
        weights,
        publisher,
        state,
        replay_until=latest or 0,
        resumed_from=resumed_from,
        logit_scale=logit_scale,
        demos=demos,
        rank=rank,
        world_size=world_size,
        device=device,
    )
