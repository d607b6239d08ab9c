"""`whetstone midtrain [CONFIG] [--set key=value ...]`: next-token training on the code corpus.

Mount without a name so the command is `whetstone midtrain`: `app.add_typer(midtrain.cli.app)`.
`run_midtrain(config)` is the same run as a function (for `whetstone run`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

if TYPE_CHECKING:
    from whetstone.data import DemoSource
    from whetstone.midtrain.config import MidtrainConfig

app = typer.Typer(no_args_is_help=True, pretty_exceptions_enable=False, help="Mid-training.")


@app.callback()
def _group() -> None:
    """Mid-training: next-token training on code before RL."""


def run_midtrain(config: "MidtrainConfig", demos: "DemoSource | None" = None) -> dict[str, Any]:
    """Train (or resume) the run described by `config`; returns the summary (see docs/midtrain.md).

    `demos` adds chat transcripts of solved train tasks to the corpus (`data.demo_weight` of rows).
    """
    from whetstone.midtrain.loop import train

    return train(config, demos=demos)


@app.command()
def midtrain(
    config: Path | None = typer.Argument(
        None, help="TOML file of MidtrainConfig fields (default: the embedded default run)."
    ),
    overrides: list[str] = typer.Option([], "--set", "-s", help="Override a field: KEY=VALUE, e.g. run.steps=50."),
    as_json: bool = typer.Option(False, "--json", help="Print the summary as one JSON object."),
) -> None:
    """Train the model on the code corpus (AdamW, warmup + cosine), resuming the run's newest checkpoint."""
    from whetstone.config import load_config
    from whetstone.midtrain.config import MidtrainConfig

    print_summary(run_midtrain(load_config(MidtrainConfig, config, overrides)), as_json)


def print_summary(summary: dict[str, Any], as_json: bool) -> None:
    """Mid-training's summary as `whetstone midtrain` prints it (rank 0 alone, under torchrun)."""
    if summary["rank"] != 0:
        return  # under torchrun, rank 0 speaks for the job
    if as_json:
        typer.echo(json.dumps(summary))
        return
    typer.echo(f"run folder      {summary['run_dir']}  (step {summary['step']} of {summary['steps']})")
    if summary["val_loss"] is not None:
        typer.echo(
            f"validation loss {summary['val_loss']:.3f} nats/token   "
            f"unigram entropy of the corpus {summary['unigram_entropy']:.3f} nats/token"
        )
    if summary["model_dir"]:
        typer.echo(f"model           {summary['model_dir']}  (Hugging Face folder, tokenizer included)")
    if not summary["finished"]:
        typer.echo("stopped before the last step; run the same command again to continue")
