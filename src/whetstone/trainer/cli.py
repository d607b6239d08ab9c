"""`whetstone trainer [CONFIG] [--set key=value ...]`: the RL trainer process.

Mount without a name so the command is `whetstone trainer`: `app.add_typer(trainer.cli.app)`.
"""

from __future__ import annotations

import json
from pathlib import Path

import typer

app = typer.Typer(no_args_is_help=True, pretty_exceptions_enable=False, help="RL trainer.")


@app.callback()
def _group() -> None:
    """The RL trainer: consumes batches, publishes weight versions."""


@app.command()
def trainer(
    config: Path | None = typer.Argument(
        None, help="TOML file of TrainerConfig fields (default: the embedded default run)."
    ),
    overrides: list[str] = typer.Option([], "--set", "-s", help="Override a field: KEY=VALUE, e.g. max_steps=20."),
    as_json: bool = typer.Option(False, "--json", help="Print the summary as one JSON object."),
) -> None:
    """Train on batch n, publish weight version n + 1, checkpoint every K steps; resumes where it stopped."""
    from whetstone.config import load_config
    from whetstone.trainer.config import TrainerConfig
    from whetstone.trainer.loop import run_trainer

    summary = run_trainer(load_config(TrainerConfig, config, overrides))
    if summary["rank"] != 0:
        return  # under torchrun, rank 0 speaks for the job
    if as_json:
        typer.echo(json.dumps(summary))
        return
    typer.echo(f"trainer folder  {summary['output_dir']}")
    typer.echo(
        f"steps           {summary['step']} (this run {summary['steps_this_run']}, "
        f"{summary['replayed']} replayed after a restart)"
    )
    typer.echo(f"weight version  {summary['version']}")
