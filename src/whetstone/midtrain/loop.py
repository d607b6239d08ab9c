"""The mid-training run: the step loop, evaluation, checkpoints, export and the summary.

Everything a run writes lives in `<run.output_dir>/<run.name>/`:

    config.toml        the config as last run
    metrics.jsonl      one record per step (loss, lr, grad norm, tokens/s) and per evaluation;
                       on resume, those of steps after the checkpoint are dropped (taken again)
    checkpoints/       step_<N>/ folders (see checkpoint.py); the newest is resumed
    model/             the trained model as a Hugging Face folder, tokenizer included
    summary.json       the summary `train` returns

Under torchrun (`torchrun --nproc_per_node N -m whetstone.cli midtrain CONFIG`) every rank runs
this loop on its share of each batch (FSDP2 over NCCL on GPUs, gloo on CPUs); rank 0 alone writes
files, and whether the wall-time limit has come or a signal asks to stop is rank 0's call, so all
ranks stop together.

SIGTERM or Ctrl-C (the first one) ends the run after the step in progress: it checkpoints that
step and raises what the signal means (`stopped_by`), without the export and the summary of a
finished run, so a caller (`whetstone run`) stops too instead of going on; the same command
resumes it. A second signal acts at once.
"""

from __future__ import annotations

import logging
import time
from contextlib import nullcontext
from functools import partial
from pathlib import Path
from typing import Any

from whetstone.config import write_toml
from whetstone.data import DemoSource
from whetstone.midtrain.config import MidtrainConfig
from whetstone.midtrain.setup import NEXT_ROW, Session, new_optimizer, open_session
from whetstone.midtrain.step import train_step, validation_loss
from whetstone.model.hf import save_hf
from whetstone.training.distributed import (
    broadcast,
    gathered_model,
    on_rank_0,
    save_sharded_checkpoint,
    torchrun_group,
)
from whetstone.training.schedule import lr_at
from whetstone.utils.atomic import atomic_write_json, write_errors
from whetstone.utils.metrics import MetricsWriter
from whetstone.utils.processes import StopRequest, stop_on_signals, stopped_by
from whetstone.utils.progress import progress_bar

log = logging.getLogger("whetstone.midtrain")


def train(
    config: MidtrainConfig, *, demos: DemoSource | None = None, stop_at_step: int | None = None
) -> dict[str, Any]:
    """Run (or continue) mid-training and return its summary (see `summarize`).

    The run ends after `run.steps`, or earlier when `run.max_wall_time` (counted from this call,
    corpus build included) runs out; either way it checkpoints, measures the validation loss and
    exports the model. `stop_at_step` checkpoints and returns after that step without exporting,
    keeping the whole run's schedule: the next call continues exactly where this one stopped
    (the bit-exact resume test uses it). SIGTERM or SIGINT checkpoints the step in progress and
    raises `stopped_by(signal)` (see the module's docstring).
    """
    opened = time.perf_counter()  # the wall-time limit counts the corpus build too
    with torchrun_group(config.run.device):
        # a signal while the corpus is built and the model set up (a minute or more on a new
        # corpus) stops at once: there is no step to checkpoint yet
        session = open_session(config, demos)
        with stop_on_signals() as stop:
            return _train(session, opened, stop_at_step, stop)


def _train(session: Session, opened: float, stop_at_step: int | None, stop: StopRequest) -> dict[str, Any]:
    config, state = session.config, session.state
    run = config.run
    lead = session.rank == 0  # the one rank that writes files
    if lead:
        write_toml(session.run_dir / "config.toml", config)
    val_batches = list(_first(session.corpus.val_batches(run.batch_size, config.data.seq_len), run.eval_batches))
    last_step = min(run.steps, stop_at_step or run.steps)
    step_tokens = run.batch_size * run.grad_accum * config.data.seq_len
    start_step, started = state.step, time.perf_counter()
    val_loss, out_of_time = None, False
    signalled = None

    with (
        # a record's step is the steps taken by then (the checkpoint's, N, among them): those after N are taken again
        MetricsWriter(
            session.run_dir / "metrics.jsonl",
            config.tracking,
            role="midtrain",
            run_config=config,
            resume_at=start_step + 1,
        )
        if lead
        else nullcontext() as metrics,
        progress_bar((last_step - start_step) * step_tokens, f"midtrain {run.name}", "tok")
        if lead
        else nullcontext() as bar,
    ):
        while state.step < last_step and not out_of_time and signalled is None:
            record = _step(session)
            elapsed = time.perf_counter() - started
            if lead:
                metrics.write({**record, "tokens_per_s": (state.step - start_step) * step_tokens / elapsed})
                bar.update(step_tokens, step=state.step, loss=record["loss"])
            # rank 0's clock and rank 0's signals: every rank stops after the same step
            out_of_time, signalled = broadcast((0 < run.max_wall_time <= time.perf_counter() - opened, stop.signal))
            ending = state.step == last_step or out_of_time
            if state.step % run.eval_interval == 0 or ending:
                val_loss = validation_loss(session.model, val_batches, run.dtype)
                if lead:
                    metrics.write({"step": state.step, "tokens": state.tokens, "val_loss": val_loss})
            if state.step % run.checkpoint_interval == 0 or ending or signalled is not None:
                _checkpoint(session)
    if signalled is not None:
        if lead:
            log.warning("%s at step %d: checkpointed; the same command resumes the run", signalled.name, state.step)
        raise stopped_by(signalled)

    if val_loss is None:  # nothing left to train (a finished run, resumed): measure it anyway
        val_loss = validation_loss(session.model, val_batches, run.dtype)
    stopped_early = out_of_time and state.step < run.steps
    model_dir = None
    if state.step == run.steps or stopped_early:
        whole = gathered_model(session.model)  # every rank takes part; rank 0 gets the model
        model_dir = on_rank_0(  # rank 0 writes it; its failure is every rank's (they would wait below)
            lambda: save_hf(whole, session.run_dir / "model", tokenizer_dir=session.corpus.path / "tokenizer"),
            f"write the model to {session.run_dir / 'model'}",
        )
    seconds = time.perf_counter() - started
    summary = summarize(session, val_loss, stopped_early, model_dir, seconds, (state.step - start_step) * step_tokens)
    on_rank_0(lambda: _write_summary(session.run_dir / "summary.json", summary), "write summary.json")
    signalled = broadcast(stop.signal)  # one that came after the last step: the run is whole, but asked to stop
    if signalled is not None:
        raise stopped_by(signalled)
    return summary


def _write_summary(path: Path, summary: dict[str, Any]) -> None:
    with write_errors(path):
        atomic_write_json(path, summary)


def _checkpoint(session: Session) -> None:
    """The run's checkpoint at this step; under torchrun every rank gathers its shards and rank 0
    writes the one-process format (so a run resumes on any number of ranks)."""
    config = session.config
    save_sharded_checkpoint(
        session.checkpoints,
        session.model,
        session.optimizer,
        partial(new_optimizer, config),
        session.state,
        config.model_dump(mode="json"),
        config.run.keep_checkpoints,
    )


def _step(session: Session) -> dict[str, Any]:
    """One optimizer step at the schedule's learning rate; advances the state; returns its metrics."""
    config, state = session.config, session.state
    run, opt = config.run, config.optimizer
    first = state.data[NEXT_ROW]
    micro_batches = [session.loader.batch_from(first + i * run.batch_size) for i in range(run.grad_accum)]
    lr = lr_at(
        state.step, peak_lr=opt.lr, warmup_steps=opt.warmup_steps, total_steps=run.steps, min_lr_ratio=opt.min_lr_ratio
    )
    stats = train_step(
        session.model,
        session.optimizer,
        micro_batches,
        lr=lr,
        dtype=run.dtype,
        grad_clip=opt.grad_clip,
        step=state.step,
    )
    state.step += 1
    state.tokens += stats.tokens
    state.data[NEXT_ROW] = first + run.grad_accum * run.batch_size
    record = {
        "step": state.step,
        "tokens": state.tokens,
        "loss": stats.loss,
        "aux_loss": stats.aux_loss,
        "lr": lr,
        "grad_norm": stats.grad_norm,
    }
    if stats.demo_loss is not None:
        record["demo_loss"] = stats.demo_loss
    return record


def summarize(
    session: Session, val_loss: float, stopped_early: bool, model_dir, seconds: float, tokens: int
) -> dict[str, Any]:
    """What `train` returns and writes to summary.json."""
    config, state, corpus = session.config, session.state, session.corpus
    return {
        "run_dir": str(session.run_dir),
        "step": state.step,
        "steps": config.run.steps,
        "finished": state.step == config.run.steps,
        "stopped_early": stopped_early,
        "tokens": state.tokens,
        "train_seconds": round(seconds, 2),
        "tokens_per_s": round(tokens / max(seconds, 1e-9), 1),
        "dtype": config.run.dtype,
        "device": str(session.device),
        "val_loss": val_loss,
        "unigram_entropy": corpus.unigram_entropy,
        "val_unigram_cross_entropy": corpus.manifest["val_unigram_cross_entropy"],
        "parameters": session.model.num_parameters(),
        "active_parameters": session.model.num_parameters(active=True),
        "model_dir": str(model_dir) if model_dir else None,
        "resumed_from": str(session.resumed_from) if session.resumed_from else None,
        "rank": session.rank,
        "world_size": session.world_size,
    }


def _first(items, count: int):
    """The first `count` items (the same validation batches at every evaluation)."""
    return (item for _, item in zip(range(count), items))
