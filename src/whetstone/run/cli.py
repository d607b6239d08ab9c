"""`whetstone run [CONFIG]`: the whole pipeline; with no config, the embedded default."""

from __future__ import annotations

import json
from pathlib import Path

import typer


def run(
    config: Path | None = typer.Argument(None, help="TOML file of run fields (default: the embedded default)."),
    overrides: list[str] = typer.Option([], "--set", "-s", help="Override a field: KEY=VALUE, e.g. midtrain.run.steps=50."),
    as_json: bool = typer.Option(False, "--json", help="Print the summary as one JSON object."),
) -> None:
    """Mid-train, then asynchronous RL (servers, trainer, orchestrator as processes) with held-out
    evaluations before and after, into runs/<name>/ (summary.json, report.html)."""
    from whetstone.config import load_config
    from whetstone.run.config import PipelineConfig
    from whetstone.run.pipeline import run_pipeline

    summary = run_pipeline(load_config(PipelineConfig, config, overrides))
    if as_json:
        typer.echo(json.dumps(summary))
        return
    midtrain = summary["stages"]["midtrain"]
    typer.echo(f"run folder       {summary['run_dir']}   ({summary['wall_s']:.0f} s)")
    if midtrain["val_loss"] is not None:
        typer.echo(f"validation loss  {midtrain['val_loss']:.3f} nats/token   "
                   f"unigram entropy {midtrain['unigram_entropy']:.3f} nats/token")  # fmt: skip
    if midtrain["model_dir"]:
        typer.echo(f"model            {midtrain['model_dir']}")
    before, after = summary["heldout_pass1_before"], summary["heldout_pass1_after"]
    if before is not None and after is not None:
        typer.echo(f"held-out pass@1  {before:.3f} -> {after:.3f}  ({100 * (after - before):+.1f} points)")
    if summary.get("report"):
        typer.echo(f"report           {summary['report']}")
