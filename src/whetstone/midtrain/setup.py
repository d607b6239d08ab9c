"""Everything a run needs before its first step: corpus, model, optimizer, and the resumed state.

The model comes from the `model` section (fresh init) or from `run.init_from`, a Hugging Face
folder (continued pre-training of a real checkpoint with its own tokenizer). Either way, the
newest checkpoint of the run, if any, then replaces weights, optimizer and counters; with
`run.resume = false` what an earlier run left in the folder is moved aside instead
(`set_aside_previous_run`).

Before any work the run folder is checked: it, its `checkpoints/` and `model/` must be (or be
creatable as) folders this process can write, or the run would fail at its first save. The
newest checkpoint is resumed only with the tokenizer it was trained with (`check_tokenizer`),
and a damaged one is refused naming the older complete ones (`naming_older_checkpoints`).
Temporary folders of saves that crashed are deleted.

Under torchrun every rank opens the same session: the corpus is built by each machine's first
rank before the others read it from the cache, every rank builds the same model (same seed) and
takes its FSDP2 shard of it (`training.distributed`), and a checkpoint, read by rank 0, reaches
every rank's shard.
"""

from __future__ import annotations

import itertools
import logging
import os
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch

from whetstone.config import expand_path
from whetstone.data import Corpus, CorpusConfig, DemoSource, TrainLoader, build_corpus
from whetstone.errors import ConfigError
from whetstone.midtrain.config import MidtrainConfig
from whetstone.model import ModelConfig, Transformer
from whetstone.model.hf import check_vocab_fits, load_hf, read_hf_config
from whetstone.training.checkpoint import (
    TOKENIZER_KEY,
    DamagedCheckpoint,
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
    barrier,
    broadcast,
    load_sharded_checkpoint,
    on_rank_0,
    shard_model,
    world,
)
from whetstone.training.optim import optimizer_for
from whetstone.utils.atomic import writable_folder_problem
from whetstone.utils.device import resolve_device, use_device
from whetstone.utils.runtime import configure_process, resolve_dtype

log = logging.getLogger("whetstone.midtrain")

CORPUS_KEY = "corpus_build"
"""`state.data` key: the cache key of the corpus build the run reads (its manifest's `key`)."""
NEXT_ROW = "next_row"
"""`state.data` key: how many training rows the run has read, where its next step's rows start
(`TrainLoader.batch_from`). Counted in rows, not batches, so a resume with another
`run.batch_size` goes on at the row where the checkpoint stopped, skipping and repeating none."""


@dataclass
class Session:
    config: MidtrainConfig
    run_dir: Path
    corpus: Corpus
    loader: TrainLoader
    model: Transformer
    optimizer: torch.optim.AdamW
    state: TrainState
    resumed_from: Path | None
    device: torch.device = torch.device("cpu")
    """Where the model, its optimizer state and the batches are (`run.device` resolved)."""
    rank: int = 0
    world_size: int = 1
    """Under torchrun: this process's rank and the number of ranks; each trains on its share of
    every micro-batch's rows (`run.batch_size` / world_size)."""

    @property
    def checkpoints(self) -> Path:
        return self.run_dir / "checkpoints"


def open_session(config: MidtrainConfig, demos: DemoSource | None = None) -> Session:
    """Build (or fetch from cache) the corpus, build the model and optimizer, resume if asked."""
    run = config.run
    configure_process(run.threads)
    device = resolve_device(run.device)  # before any work: `cuda` on a machine without one fails here
    use_device(device)
    rank, world_size = world()
    if run.batch_size % world_size:
        raise ConfigError(
            f"run.batch_size ({run.batch_size}) must be a multiple of the {world_size} ranks: each trains "
            "on an equal share of every micro-batch's rows"
        )
    run_dir = run.run_dir
    problem = broadcast(_run_folder_problem(run_dir) if rank == 0 else None)  # the folders rank 0 writes
    if problem:
        raise ConfigError(f"{problem}: the run writes {run_dir} (run.output_dir / run.name)")
    model_config = resolve_model_config(config)  # before the corpus build: fail fast on a bad checkpoint
    if config.data.seq_len > model_config.max_position_embeddings:
        raise ConfigError(
            f"data.seq_len ({config.data.seq_len}) is longer than the model's max_position_embeddings "
            f"({model_config.max_position_embeddings}), the longest context it is served with: shorten "
            f"data.seq_len, or raise model.max_position_embeddings when training from scratch"
        )
    corpus = _corpus_in_rank_order(config, demos)
    if rank == 0:
        for stale in remove_stale_temporaries(run_dir / "checkpoints"):
            log.warning("deleted %s, left by a checkpoint save that did not finish", stale)
    resume_from = broadcast(latest_checkpoint(run_dir / "checkpoints") if run.resume else None)  # rank 0's view
    if resume_from is not None and checkpoint_step(resume_from) > run.steps:
        raise ConfigError(
            f"{resume_from} is past run.steps = {run.steps}: resuming would use its later weights. "
            f"Raise run.steps to at least {checkpoint_step(resume_from)}, or use a new run name"
        )
    tokenizer = tokenizer_identity(corpus.path / "tokenizer")
    recorded = None  # the checkpoint's state.json, read by rank 0 before any model work
    next_row = 0
    if resume_from is not None:  # refused on every rank: the others would wait in the load's collective

        def check_resumable() -> None:
            nonlocal recorded, next_row
            with naming_older_checkpoints(resume_from):
                recorded = read_state(resume_from)
                next_row = _resumed_row(resume_from, recorded)
            check_tokenizer(
                resume_from, recorded["data"], tokenizer, "corpus tokenizer", _tokenizer_advice(config, recorded)
            )
            _say_if_another_corpus(resume_from, recorded["data"], corpus.manifest["key"], next_row)
            _say_if_other_windows(resume_from, recorded, config, next_row)

        on_rank_0(check_resumable, f"read checkpoint {resume_from}")
    model = shard_model(_build_model(config, model_config, corpus, resuming=resume_from is not None), device)
    model.activation_checkpointing = run.activation_checkpointing
    optimizer = new_optimizer(config, model)  # after the move: fused AdamW on CUDA
    state = TrainState(data={NEXT_ROW: 0})
    if resume_from is not None:
        state = load_sharded_checkpoint(resume_from, model, optimizer, partial(new_optimizer, config))
        state.data.pop("next_batch", None)  # a position in batches of another size, held as rows now
        state.data[NEXT_ROW] = broadcast(next_row)
    elif not run.resume and rank == 0:  # a fresh start: nothing of an earlier run in this folder mixes in
        set_aside_previous_run(run_dir)
    if tokenizer is not None:
        state.data[TOKENIZER_KEY] = tokenizer  # recorded in every checkpoint from here on
    state.data[CORPUS_KEY] = corpus.manifest["key"]
    loader = corpus.train_loader(
        run.batch_size, config.data.seq_len, seed=run.seed, demo_weight=config.data.demo_weight
    )
    # The config as run: with init_from, the model section is the checkpoint's; `auto` resolved.
    if run.dtype == "auto" and resume_from is not None:  # read by rank 0, like the checkpoint
        dtype = broadcast(_resumed_dtype(recorded, device) if rank == 0 else None)
    else:
        dtype = resolve_dtype(run.dtype, device)
    config = config.model_copy(update={"model": model.cfg, "run": run.model_copy(update={"dtype": dtype})})
    return Session(config, run_dir, corpus, loader, model, optimizer, state, resume_from, device, rank, world_size)


RUN_OUTPUTS = ("checkpoints", "metrics.jsonl", "summary.json", "model", "tensorboard", "wandb")
"""What a run writes into its folder besides config.toml (which every start rewrites)."""


def set_aside_previous_run(run_dir: Path) -> Path | None:
    """Move what an earlier run left in `run_dir` (`RUN_OUTPUTS`) into `run_dir/previous/<UTC
    time>/`, for a fresh start (`run.resume = false`); return that folder, or None when there
    was nothing to move.

    Left in place, the earlier run's checkpoints would mix with the new run's: pruning keeps the
    highest steps, so an older, longer run's would outlive the new ones (and be overwritten at
    the steps both reach), and a later resume would continue the older run. Moved aside, they are
    kept for whoever wants them, and the new run starts from an empty folder.
    """
    found = [run_dir / name for name in RUN_OUTPUTS if (run_dir / name).exists()]
    if not found:
        return None
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    target = run_dir / "previous" / stamp
    for number in itertools.count(2):
        if not target.exists():
            break
        target = run_dir / "previous" / f"{stamp}-{number}"
    target.mkdir(parents=True)
    for path in found:
        path.rename(target / path.name)
    log.warning("run.resume = false: the earlier run in %s was moved to %s", run_dir, target)
    return target


def new_optimizer(config: MidtrainConfig, model: torch.nn.Module) -> torch.optim.AdamW:
    """The configured AdamW over `model` (sharded or plain)."""
    return optimizer_for(model, config.optimizer)


def _corpus_in_rank_order(config: MidtrainConfig, demos: DemoSource | None) -> Corpus:
    """The built corpus. Under torchrun rank 0 builds it (or finds it in the cache) while the
    others wait; then each other machine's first rank (LOCAL_RANK 0) finds it where the machines
    share the cache folder, or builds its own where they do not; then the rest open it. So no two
    ranks ever build into one cache folder at once."""
    corpus = build_corpus(corpus_config(config), demos) if world()[0] == 0 else None
    barrier()
    if corpus is None and int(os.environ.get("LOCAL_RANK", "0")) == 0:
        corpus = build_corpus(corpus_config(config), demos)
    barrier()
    return corpus if corpus is not None else build_corpus(corpus_config(config), demos)


def _resumed_dtype(record: dict, device: torch.device) -> str:
    """`auto` on resume: the dtype the checkpoint (its state.json: `record`) was trained in, so a
    run keeps its arithmetic (bit-exact continuation) even where `auto` would now pick another
    (older runs defaulted to float32)."""
    run = record.get("config", {}).get("run")
    recorded = run.get("dtype") if isinstance(run, dict) else None
    return recorded if recorded in ("bfloat16", "float32") else resolve_dtype("auto", device)


def _run_folder_problem(run_dir: Path) -> str | None:
    """Why the run could not write its folder, checkpoints or exported model, or None."""
    for folder in (run_dir, run_dir / "checkpoints", run_dir / "model"):
        if problem := writable_folder_problem(folder):
            return problem
    return None


def _resumed_row(checkpoint: Path, record: dict) -> int:
    """The training row the run of `checkpoint` (its state.json: `record`) reads next: its
    `NEXT_ROW`, or, where it counted micro-batches instead (`data.next_batch`), that many of the
    `run.batch_size` rows it trained with. A position that is not a count is `DamagedCheckpoint`."""
    data = record["data"]
    if NEXT_ROW in data:
        row = data[NEXT_ROW]
        if isinstance(row, bool) or not isinstance(row, int) or row < 0:
            raise DamagedCheckpoint(
                f"checkpoint file {checkpoint / 'state.json'} is corrupt: "
                f"data.{NEXT_ROW} is {row!r}, not a count (an integer >= 0)"
            )
        return row
    run = record.get("config", {}).get("run")
    batch_size = run.get("batch_size") if isinstance(run, dict) else None
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise DamagedCheckpoint(
            f"checkpoint file {checkpoint / 'state.json'} is corrupt: it has no data.{NEXT_ROW}, and its "
            f"config.run.batch_size ({batch_size!r}), which turns data.next_batch into rows, is not an integer >= 1"
        )
    return data.get("next_batch", 0) * batch_size


def _say_if_another_corpus(checkpoint: Path, data: dict, key: str, next_row: int) -> None:
    """Warn when `checkpoint` was trained on another corpus build than the one this run reads
    (`key`): its data position (`next_row`) goes on in this build, so the batches after it are
    not the ones the run would have had. Not refused: a corpus grown or filtered anew is a way to
    go on training (another tokenizer, which would change the token ids, is refused)."""
    recorded = data.get(CORPUS_KEY)
    if recorded is not None and recorded != key:
        log.warning(
            "checkpoint %s was trained on the corpus build %s, and this run reads %s (its sources, its data "
            "settings or the tokenizer's encoding version changed): rows go on from number %d of this build, "
            "not in the order the run had",
            checkpoint,
            recorded,
            key,
            next_row,
        )


WINDOW_SETTINGS = ("seq_len", "demo_weight")
"""The data settings that decide which window of the corpus each row is (its length, and how
rows are dealt between code and demonstrations), beside the corpus build itself."""


def _say_if_other_windows(checkpoint: Path, record: dict, config: MidtrainConfig, next_row: int) -> None:
    """Warn when `checkpoint` was trained with other `WINDOW_SETTINGS`: its data position
    (`next_row`) counts rows of other windows, so some of the rows it read come again and others
    are never read. Not refused: a longer sequence or another mix is a way to go on training."""
    trained = record.get("config", {}).get("data", {})
    if not isinstance(trained, dict):
        return
    changed = [
        f"data.{key} = {trained[key]!r} -> {getattr(config.data, key)!r}"
        for key in WINDOW_SETTINGS
        if key in trained and trained[key] != getattr(config.data, key)
    ]
    if changed:
        log.warning(
            "checkpoint %s was trained with other windows of the corpus (%s): rows go on from number %d "
            "of this run's windows, so some windows it read come again and others are not read",
            checkpoint,
            "; ".join(changed),
            next_row,
        )


def _tokenizer_advice(config: MidtrainConfig, record: dict) -> str:
    """What to do about a resume refused for its tokenizer: the data settings (and run.init_from)
    that differ from the checkpoint's config, and the ways out."""
    trained = record.get("config", {})
    now = config.model_dump(mode="json")
    changed = [
        f"{section}.{key} = {trained[section].get(key)!r} -> {value!r}"
        for section, keys in (("data", None), ("run", ("init_from",)))
        if isinstance(trained.get(section), dict)
        for key, value in now[section].items()
        if (keys is None or key in keys) and trained[section].get(key) != value
    ]
    settings = f" ({'; '.join(changed)})" if changed else ""
    return (
        f"Resume with the data settings the checkpoint was trained with{settings}, or train a new run: "
        "another run.name, or run.resume = false"
    )


def corpus_config(config: MidtrainConfig) -> CorpusConfig:
    """A run that starts from a Hugging Face checkpoint tokenizes with that checkpoint's tokenizer."""
    if config.run.init_from and not config.data.tokenizer:
        return config.data.model_copy(update={"tokenizer": config.run.init_from})
    return config.data


def resolve_model_config(config: MidtrainConfig) -> ModelConfig:
    """The `model` section, or `run.init_from`'s config.json; a field set in both must agree."""
    init_from = config.run.init_from
    if not init_from:
        return config.model
    from_checkpoint = read_hf_config(init_from)
    # Only what the user wrote in a model section counts, not the embedded default's sizes.
    user_fields = config.model.model_fields_set if "model" in config.model_fields_set else set()
    for field in sorted(user_fields):
        if getattr(config.model, field) != getattr(from_checkpoint, field):
            raise ConfigError(
                f"model.{field} = {getattr(config.model, field)!r}, but run.init_from ({init_from}) has "
                f"{getattr(from_checkpoint, field)!r}; drop it from the model section"
            )
    return from_checkpoint


def _build_model(config: MidtrainConfig, model_config: ModelConfig, corpus: Corpus, resuming: bool) -> Transformer:
    """A fresh init, or `run.init_from`'s weights (not when resuming: the checkpoint's replace them)."""
    source = corpus.manifest["tokenizer"]["source"]
    tokenizer = f"{corpus.path / 'tokenizer' / 'tokenizer.json'} of the corpus " + (
        "(trained on it: data.vocab_size)" if source == "trained" else f"(from {source})"
    )
    if config.run.init_from:
        model = f"{expand_path(config.run.init_from) / 'config.json'}: run.init_from"
        advice = "Tokenize with the tokenizer run.init_from was trained with (data.tokenizer empty: its own)"
    else:
        model = "model.vocab_size"
        smaller = "lower data.vocab_size" if source == "trained" else "use a data.tokenizer with fewer ids"
        advice = f"Set model.vocab_size to at least {corpus.vocab_size}, or {smaller}"
    check_vocab_fits(corpus.vocab_size, tokenizer, model_config.vocab_size, model, advice)
    torch.manual_seed(config.run.seed)
    if config.run.init_from and not resuming:
        return load_hf(config.run.init_from)
    return Transformer(model_config)
