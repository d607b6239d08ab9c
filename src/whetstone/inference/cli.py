"""`whetstone serve [CONFIG]`: the OpenAI-compatible inference server (see docs/inference.md)."""

from __future__ import annotations

from pathlib import Path

import typer

app = typer.Typer(no_args_is_help=True, pretty_exceptions_enable=False, help="Inference server.")


@app.callback()
def _group() -> None:
    """Inference: the batched engine and its OpenAI-compatible server."""


@app.command()
def serve(
    config: Path | None = typer.Argument(
        None, help="TOML file of ServeConfig fields (optional: fields it leaves out keep their defaults)."
    ),
    overrides: list[str] = typer.Option(
        [], "--set", "-s", help="Override a field: KEY=VALUE, e.g. engine.max_batch=8."
    ),
) -> None:
    """Serve a model over HTTP: /v1/completions, /v1/chat/completions, /v1/models, /health, /metrics."""
    from whetstone.config import load_config
    from whetstone.inference.config import ServeConfig
    from whetstone.inference.launch import serve as run

    run(load_config(ServeConfig, config, overrides))


if __name__ == "__main__":  # `python -m whetstone.inference.cli serve ...` is `whetstone serve ...`
    import sys

    from whetstone.cli import main

    main(sys.argv[1:])
