"""The `whetstone` command. Each role keeps its own subcommands in `<role>/cli.py`; this file
only assembles them, turns `WhetstoneError` into a clean message and exit code 2, and a Ctrl-C
(or SIGTERM, where a command takes it: `sigterm_raises`) into one line and exit code 130 (143)."""

from __future__ import annotations

import signal
from importlib import metadata

import typer
from rich.console import Console
from rich.markup import escape
from typer.core import TyperGroup

from whetstone.bench.cli import app as bench_app
from whetstone.data.cli import app as corpus_app
from whetstone.envs.cli import app as tasks_app
from whetstone.envs.eval.cli import eval_command
from whetstone.errors import AccessDeniedError, WhetstoneError
from whetstone.inference.cli import serve
from whetstone.midtrain.cli import midtrain
from whetstone.online.cli import app as online_app
from whetstone.orchestrator.cli import orchestrator
from whetstone.run.cli import run
from whetstone.sync.cli import app as sync_app
from whetstone.trainer.cli import trainer
from whetstone.utils.processes import FailedElsewhere, Terminated, apply_role_environment, exit_process


class _Interrupted(BaseException):
    """A Ctrl-C (KeyboardInterrupt), or a SIGTERM where a command takes it (`Terminated`, of its
    kind), carried past typer, which would end the process on it with code 130 and no word of why
    (click: "Aborted!" and code 1), to `main`; its cause is the signal's exception."""


class _Commands(TyperGroup):
    """The `whetstone` group: a Ctrl-C while a command parses its arguments or runs reaches `main`
    (a command's arguments are parsed within the group's `invoke`)."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except KeyboardInterrupt as interrupt:
            raise _Interrupted from interrupt


app = typer.Typer(
    name="whetstone",
    cls=_Commands,
    help="Mid-training, asynchronous RL in sandboxes, delta weight sync and online RL for coding agents.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)

app.add_typer(corpus_app, name="corpus", help="Build and inspect the code corpus.")
app.command("run")(run)
app.command("midtrain")(midtrain)
app.command("serve")(serve)
app.command("trainer")(trainer)
app.command("orchestrator")(orchestrator)
app.command("eval")(eval_command)
app.add_typer(tasks_app, name="tasks", help="Validate, list, show and export coding tasks.")
app.add_typer(sync_app, name="sync", help="Publish, watch and inspect the versioned weight store.")
app.add_typer(
    online_app,
    name="online",
    help="Online RL from users' feedback: `online [CONFIG]` runs the gated update loop; "
    "`online rollback VERSION [CONFIG]`.",
)
app.add_typer(bench_app, name="bench")


def _print_version(asked: bool) -> None:
    if asked:
        typer.echo(f"whetstone {package_version()}")
        raise typer.Exit()


@app.callback()
def _options(
    version: bool = typer.Option(
        False, "--version", callback=_print_version, is_eager=True, help="Print the installed version and exit."
    ),
) -> None:
    """Options of `whetstone` itself, given before the command."""


def package_version() -> str:
    """The installed package's version (its metadata); the source tree's when run uninstalled."""
    try:
        return metadata.version("whetstone")
    except metadata.PackageNotFoundError:
        from whetstone import __version__

        return __version__


def _print_error(message: str) -> None:
    """`error: message` on stderr, its lines as they are: not wrapped at the console's width
    (80 columns in a file: a role's log would break a path in two)."""
    Console(stderr=True, soft_wrap=True, emoji=False).print(f"[bold red]error:[/] {escape(message)}", highlight=False)


def main(args: list[str] | None = None) -> None:
    """The `whetstone` command, on the process's arguments or on `args` (`python -m
    whetstone.bench.sync ARGS` is `main(["bench", "sync", *ARGS])`)."""
    apply_role_environment()
    try:
        app(args=args, prog_name="whetstone" if args is not None else None)
    except SystemExit as done:  # how typer ends
        exit_process(done.code)
    except (WhetstoneError, AccessDeniedError) as err:
        _print_error(str(err))
        exit_process(2)
    except (KeyboardInterrupt, _Interrupted) as stopped:  # the roles it started are stopped by now
        raised = stopped.__cause__ if isinstance(stopped, _Interrupted) else stopped
        if isinstance(raised, FailedElsewhere):
            _print_error(str(raised.error))
            exit_process(2)
        signal_number = signal.SIGTERM if isinstance(raised, Terminated) else signal.SIGINT
        Console(stderr=True, soft_wrap=True).print(f"stopped by {signal_number.name}", highlight=False)
        exit_process(128 + signal_number)
    exit_process(0)


if __name__ == "__main__":
    main()
