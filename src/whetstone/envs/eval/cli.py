"""`whetstone eval [CONFIG]`: pass@k of a served model over a task set (see docs/harness.md).

Mount without a name so the command is `whetstone eval`: `app.add_typer(whetstone.envs.eval.cli.app)`.
"""

from __future__ import annotations

import json
from pathlib import Path

import typer

app = typer.Typer(no_args_is_help=True, pretty_exceptions_enable=False, help="Evaluate a served model.")


@app.callback()
def _group() -> None:
    """Evaluation: run an endpoint over a task set through the agent harness."""


@app.command("eval")
def eval_command(
    config: Path | None = typer.Argument(
        None, help="TOML file of EvalConfig fields (optional: fields it leaves out keep their defaults)."
    ),
    overrides: list[str] = typer.Option([], "--set", "-s", help="Override a field: KEY=VALUE, e.g. samples=8."),
    as_json: bool = typer.Option(False, "--json", help="Print the report as one JSON object on stdout."),
) -> None:
    """Run every task `samples` times against the endpoint; report pass@k, rewards, cheat flags, turns and tokens."""
    from whetstone.config import load_config
    from whetstone.envs.eval.config import EvalConfig
    from whetstone.envs.eval.run import evaluate_with_progress, load_eval_tasks

    settings = load_config(EvalConfig, config, overrides)
    report = evaluate_with_progress(settings, load_eval_tasks(settings))  # progress on stderr
    if as_json:
        typer.echo(json.dumps(report, sort_keys=True))
        return
    scores = "  ".join(f"pass@{k} {value:.3f}" for k, value in report["pass_at_k"].items())
    failed = f"{report['failed_rollouts']}/{report['rollouts']}"
    reward, turns = report["reward"]["mean"], report["turns"]["mean"]  # None: not measured (no rollout ran)
    typer.echo(
        f"{report['model']}: {scores}  reward {'not measured' if reward is None else f'{reward:.3f}'}  "
        f"turns {'not measured' if turns is None else f'{turns:.1f}'}  failed {failed}"
    )
    typer.echo(f"report: {Path(settings.output_dir) / 'report.md'}")


if __name__ == "__main__":  # `python -m whetstone.envs.eval.cli eval ...` is `whetstone eval ...`
    import sys

    from whetstone.cli import main

    main(sys.argv[1:])
