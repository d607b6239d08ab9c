"""`whetstone online [CONFIG]`: the online RL loop; `whetstone online rollback VERSION`: serve an
earlier version again. See docs/online.md."""

from __future__ import annotations

import json
from pathlib import Path

import typer
from typer.core import TyperGroup


class _LoopByDefault(TyperGroup):
    """`whetstone online [CONFIG] [--set ...]` runs the loop: anything that is not a subcommand
    (or --help) goes to `run`."""

    def parse_args(self, ctx, args):
        if not args or (args[0] not in self.commands and args[0] not in ("--help", "-h")):
            args = ["run", *args]
        return super().parse_args(ctx, args)


app = typer.Typer(
    cls=_LoopByDefault,
    pretty_exceptions_enable=False,
    help="Online RL from users' feedback: `online [CONFIG]` (= `online run`) runs the loop.",
)

CONFIG = typer.Argument(None, help="TOML file of OnlineConfig fields (default: the embedded default).")
OVERRIDES = typer.Option([], "--set", "-s", help="Override a field: KEY=VALUE, e.g. trigger.every_events=16.")


@app.command()
def run(
    config: Path | None = CONFIG,
    overrides: list[str] = OVERRIDES,
    as_json: bool = typer.Option(False, "--json", help="Print the summary as one JSON object."),
) -> None:
    """Feedback on the deployed model -> a policy-gradient step -> held-out gate -> publish or discard."""
    import logging
    import os

    from whetstone.config import load_config
    from whetstone.online.config import OnlineConfig
    from whetstone.online.loop import OnlineLoop

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    loaded = load_config(OnlineConfig, config, overrides)
    os.nice(loaded.nice)
    summary = OnlineLoop(loaded).run()
    typer.echo(
        json.dumps(summary)
        if as_json
        else f"online folder {summary['output_dir']}: version {summary['version']}, {summary['updates']} updates "
        f"({summary['published']} published, {summary['discarded']} discarded, {summary['skipped']} skipped)"
    )


@app.command()
def rollback(
    version: int = typer.Argument(..., help="The earlier weight version to serve again."),
    config: Path | None = typer.Argument(
        None, help="The loop's TOML file of OnlineConfig fields (for its weight store)."
    ),
    overrides: list[str] = OVERRIDES,
) -> None:
    """Republish VERSION's weights as the newest version: servers switch to it without restarting,
    and a running loop adopts it at its next update."""
    from whetstone.config import load_config
    from whetstone.online.config import OnlineConfig
    from whetstone.online.weights import rollback as republish

    sync = load_config(OnlineConfig, config, overrides).sync
    manifest = republish(sync, version)
    typer.echo(
        f"version {version} republished as version {manifest.version} in {sync.store}; servers following "
        f"the store switch to it within sync.poll_interval ({sync.poll_interval:g} s)"
    )
