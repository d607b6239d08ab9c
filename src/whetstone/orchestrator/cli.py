"""`whetstone orchestrator [CONFIG]`: rollouts on the inference servers, batches for the trainer
(see docs/orchestrator.md)."""

from __future__ import annotations

from pathlib import Path

import typer

app = typer.Typer(no_args_is_help=True, pretty_exceptions_enable=False, help="RL orchestrator.")


@app.callback()
def _group() -> None:
    """Orchestrator: keeps inference servers busy with rollouts and feeds the trainer batches."""


@app.command()
def orchestrator(
    config: Path | None = typer.Argument(
        None, help="TOML file of OrchestratorConfig fields (optional: fields it leaves out keep their defaults)."
    ),
    overrides: list[str] = typer.Option([], "--set", "-s", help="Override a field: KEY=VALUE, e.g. group_size=4."),
) -> None:
    """Run rollouts of the task set on the servers and put batches in the batch store, never more
    than max_off_policy_steps ahead of the trainer's published weights."""
    import asyncio
    import logging

    from whetstone.config import load_config
    from whetstone.envs.harness.loop import AgentHarness
    from whetstone.orchestrator.config import OrchestratorConfig
    from whetstone.orchestrator.loop import Orchestrator
    from whetstone.utils.processes import sigterm_raises
    from whetstone.utils.progress import progress_bar

    settings = load_config(OrchestratorConfig, config, overrides)
    harness = AgentHarness.from_config(settings.harness)  # a missing tokenizer is named before the stores are created
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request drowns the orchestrator's own log
    # SIGTERM (`whetstone run` stopping it, a scheduler) cancels the rollouts as Ctrl-C does: their
    # sandboxes are closed, the status and metrics written, the sandbox folders and groups removed
    with sigterm_raises(), progress_bar(settings.max_batches or None, "orchestrator", "batch") as bar:  # on stderr

        def done(meta: dict) -> None:
            bar.update(1, reward=meta["reward_mean"] or 0.0, samples=meta["samples"])

        put = asyncio.run(Orchestrator(settings, harness=harness).run(on_batch=done))
    typer.echo(f"put batches {put[0]}..{put[-1]} in {settings.batch_store}" if put else "put no batch")


if __name__ == "__main__":  # `python -m whetstone.orchestrator.cli orchestrator ...` is `whetstone orchestrator ...`
    import sys

    from whetstone.cli import main

    main(sys.argv[1:])
