"""`whetstone run [CONFIG]`: the whole pipeline; with no config, the embedded default."""

from __future__ import annotations

import json
import os
from pathlib import Path

import typer


def run(
    config: Path | None = typer.Argument(None, help="TOML file of run fields (default: the embedded default)."),
    overrides: list[str] = typer.Option(
        [], "--set", "-s", help="Override a field: KEY=VALUE, e.g. midtrain.run.steps=50."
    ),
    as_json: bool = typer.Option(False, "--json", help="Print the summary as one JSON object (not with --dry-run)."),
    dry_run: bool = typer.Option(
        False,
        "--dry-run",
        help="Check the config (paths, task sources, cores, run folder; with --midtrain-only, what "
        "mid-training needs) and print it as the stages would run it, as TOML; run nothing.",
    ),
    midtrain_only: bool = typer.Option(
        False,
        "--midtrain-only",
        help="Run only the mid-training stage, with the run's demonstrations, placed as the run "
        "places it (placement.midtrain_ranks, placement.ray.midtrain), or under torchrun on its "
        "ranks; a later `whetstone run` of the same config takes the finished model.",
    ),
) -> None:
    """Mid-train, then asynchronous RL (servers, trainer, orchestrator as processes) with held-out
    evaluations before and after, into runs/<name>/ (summary.json, report.html, model/)."""
    from whetstone.config import dump_toml, load_config
    from whetstone.errors import ConfigError
    from whetstone.midtrain.cli import print_summary
    from whetstone.run.config import PipelineConfig
    from whetstone.run.local_ranks import PLACED_RANK_ENV
    from whetstone.run.pipeline import Pipeline, midtrain_stage, run_pipeline
    from whetstone.run.preflight import check_run_config
    from whetstone.utils.processes import sigterm_raises

    if dry_run and as_json:
        raise ConfigError(
            "--dry-run prints the resolved config as TOML; --json is for a run's summary: give one of them"
        )
    loaded = load_config(PipelineConfig, config, overrides)
    torchrun = int(os.environ.get("WORLD_SIZE") or 1) > 1
    if midtrain_only and not dry_run:
        if torchrun or os.environ.get(PLACED_RANK_ENV):  # a rank: of torchrun's, or of those a run placed
            print_summary(midtrain_stage(loaded.resolved()), as_json)
            return
        pipeline = Pipeline(loaded)
        check_run_config(pipeline.config, midtrain_only=True)  # what mid-training reads, its devices
        with pipeline.roles_stopped(), sigterm_raises():
            summary = pipeline.midtrain_alone()
        print_summary(summary, as_json)
        return
    if torchrun and not dry_run:
        raise ConfigError(
            "whetstone run under torchrun: only its mid-training runs on ranks (--midtrain-only); "
            "start the whole run as one process (placement.ray.trainer_ranks shards its trainer)"
        )
    if dry_run:
        resolved = loaded.resolved()
        check_run_config(resolved, midtrain_only=midtrain_only)
        typer.echo(dump_toml(resolved))
        return
    with sigterm_raises():  # the pipeline's roles are stopped cleanly on SIGTERM too, as on Ctrl-C
        summary = run_pipeline(loaded)
    if as_json:
        typer.echo(json.dumps(summary))
        return
    midtrain = summary["stages"]["midtrain"]
    typer.echo(f"run folder       {summary['run_dir']}   ({summary['wall_s']:.0f} s)")
    if midtrain["val_loss"] is not None:
        typer.echo(
            f"validation loss  {midtrain['val_loss']:.3f} nats/token   "
            f"unigram entropy {midtrain['unigram_entropy']:.3f} nats/token"
        )
    before, after = summary["heldout_pass1_before"], summary["heldout_pass1_after"]
    if before is not None and after is not None:
        at = f"at temperature {summary['headline_temperature']:g}"
        typer.echo(f"held-out pass@1  {before:.3f} -> {after:.3f}  ({100 * (after - before):+.1f} points, {at})")
    if summary.get("gain_over_best_temperature") is not None:
        sweep, se = summary["temperature_sweep"], summary["gain_over_best_temperature_se"]
        bests = f"{sweep['best_before']['pass1']:.3f} (T {sweep['best_before']['temperature']:g}) -> "
        bests += f"{sweep['best_after']['pass1']:.3f} (T {sweep['best_after']['temperature']:g})"
        spread = f" ± {100 * se:.1f}" if se is not None else ""
        typer.echo(f"at best T        {bests}  ({100 * summary['gain_over_best_temperature']:+.1f}{spread} points)")
    if summary["final_logit_scale"] is not None:
        typer.echo(f"logit scale      {summary['final_logit_scale']:.3f} (learned by RL)")
    typer.echo(f"model            {summary['model']}  (Hugging Face folder, tokenizer included)")
    if summary.get("report"):
        typer.echo(f"report           {summary['report']}")
