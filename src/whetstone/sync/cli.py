"""`whetstone sync publish|watch|inspect|withdraw`: the weight store by hand.

Only `publish` creates a store; the others read one, and a local store that does not exist is
an error naming it (a mistyped path), not a new empty directory."""

from __future__ import annotations

import math
import time
from pathlib import Path

import typer

app = typer.Typer(help="Publish, follow and inspect versioned weights (delta-compressed).", no_args_is_help=True)

STORE = typer.Argument(..., help="Weight store: a directory or s3://bucket/prefix.")
ENDPOINT = typer.Option(None, "--endpoint-url", help="S3 endpoint for non-AWS stores (MinIO, moto...).")


_OPTIONS = {
    "store": "STORE",
    "endpoint_url": "--endpoint-url",
    "publish_dtype": "--dtype",
    "keyframe_interval": "--keyframe-interval",
    "poll_interval": "--poll-interval",
}
"""The option that sets each `SyncConfig` field `_open` fills, to name it in errors."""

PUBLISH_DTYPES = ("bfloat16", "float16", "float32", "keep")
"""What `sync publish --dtype` takes: `SyncConfig.publish_dtype` but `autocast`, which needs the
model's embedding tables (kept in fp32) that a bare state dict does not name."""


def _open(store: str, endpoint_url: str | None, create: bool = False, **overrides):
    from pydantic import ValidationError

    from whetstone.config import format_validation_error
    from whetstone.errors import ConfigError
    from whetstone.sync import SyncConfig, WeightStore

    try:
        config = SyncConfig(store=store, endpoint_url=endpoint_url, **overrides)
    except ValidationError as err:
        raise ConfigError(format_validation_error(err, "command-line options", _OPTIONS)) from None
    return WeightStore.open(config, create=create), config


def _load_state(path: Path) -> dict:
    from safetensors.torch import load_file

    from whetstone.errors import WhetstoneError

    if not path.is_file():
        raise WhetstoneError(f"checkpoint {path} does not exist")
    try:
        return load_file(str(path))
    except Exception as err:  # safetensors raises its own types for bad headers
        raise WhetstoneError(f"checkpoint {path} is not a readable safetensors file: {err}") from None


@app.command()
def publish(
    store: str = STORE,
    checkpoint: Path = typer.Argument(..., help="A .safetensors state dict to publish as the next version."),
    full: bool = typer.Option(False, "--full", help="Publish a full version (keyframe) instead of a delta."),
    dtype: str = typer.Option(
        "bfloat16",
        help="Dtype floats are published in: bfloat16, float16, float32, keep (as stored in the file). "
        "Not autocast: it needs the model's embedding tables, so only the trainer publishes it.",
    ),
    keyframe_interval: int = typer.Option(20, help="A full version every this many versions."),
    endpoint_url: str | None = ENDPOINT,
) -> None:
    """Publish a checkpoint as the next version, as a delta on the latest one when possible."""
    from whetstone.errors import ConfigError
    from whetstone.sync import Publisher

    if dtype == "autocast":  # it keeps the embedding tables in fp32, which a bare state dict does not name
        raise ConfigError("--dtype autocast needs the model's embedding tables: publish from the trainer, or use keep")
    if dtype not in PUBLISH_DTYPES:
        raise ConfigError(f"--dtype {dtype!r} is not one of {', '.join(PUBLISH_DTYPES)}")

    weights, config = _open(store, endpoint_url, create=True, publish_dtype=dtype, keyframe_interval=keyframe_interval)
    publisher = Publisher(weights, config)
    if publisher.resume() is None and weights.latest() is not None:
        typer.echo(
            f"version {weights.latest()} cannot be rebuilt (see the warning; `whetstone sync inspect "
            f"{store} --verify`): publishing a keyframe after it",
            err=True,
        )
    manifest = publisher.publish(_load_state(checkpoint), full=full)
    typer.echo(
        f"published version {manifest.version} ({manifest.kind}): {manifest.raw_bytes / 1e6:.2f} MB "
        f"-> {manifest.encoded_bytes / 1e6:.3f} MB, {manifest.ratio:.1f}x, {manifest.changed} values changed"
    )


@app.command()
def watch(
    store: str = STORE,
    save: Path | None = typer.Option(None, help="Write the weights to this .safetensors file after each version."),
    until: int | None = typer.Option(None, help="Exit once this version (or newer) is held."),
    timeout: float | None = typer.Option(None, help="Exit after this many seconds."),
    poll_interval: float = typer.Option(0.5, help="Seconds between checks of the store."),
    endpoint_url: str | None = ENDPOINT,
) -> None:
    """Follow the store like an inference server does, printing each version taken."""
    from safetensors.torch import save_file

    from whetstone.errors import ConfigError, WhetstoneError
    from whetstone.sync import Subscriber
    from whetstone.utils.atomic import atomic_path
    from whetstone.utils.processes import sigterm_raises

    if timeout is not None and not math.isfinite(timeout):  # NaN is never reached: it would watch forever
        raise ConfigError(f"--timeout must be a finite number of seconds, got {timeout:g}")
    weights, config = _open(store, endpoint_url, poll_interval=poll_interval)
    subscriber = Subscriber(weights, config, name="watch")
    deadline = None if timeout is None else time.monotonic() + timeout
    shown = set(subscriber.rejected)
    with sigterm_raises():  # SIGTERM in a save removes its temporary file, as Ctrl-C does
        while True:
            before = subscriber.version
            started = time.perf_counter()
            subscriber.try_poll()  # a store hiccup is logged and retried
            update = subscriber.take_update()
            for version, reason in subscriber.rejected.items():
                if version not in shown:
                    shown.add(version)
                    typer.echo(f"rejected version {version}: {reason}", err=True)
            if update is not None:
                typer.echo(
                    f"version {'(none)' if before is None else before} -> {subscriber.version}: "
                    f"{update.values_written} values written, "
                    f"fetched and decoded in {time.perf_counter() - started:.3f}s"
                )
                if save is not None:
                    with atomic_path(save) as tmp:
                        save_file({k: v.contiguous() for k, v in subscriber.state.items()}, str(tmp))
            if until is not None and subscriber.version is not None and subscriber.version >= until:
                return
            if deadline is not None and time.monotonic() >= deadline:
                if until is not None:
                    blocked = subscriber.blocked()
                    raise WhetstoneError(
                        f"version {until} not reached within {timeout:g} s: holding {subscriber.version}, "
                        f"the store's latest is {subscriber.latest}" + (f"; {blocked}" if blocked else "")
                    )
                return
            time.sleep(poll_interval)


@app.command()
def inspect(
    store: str = STORE,
    verify: bool = typer.Option(
        False,
        "--verify",
        help="Read every chunk of every version and check it (size, "
        "checksum, header) and each delta's base; exit non-zero naming what fails.",
    ),
    endpoint_url: str | None = ENDPOINT,
) -> None:
    """Print the version chain: kind, base, sizes and compression ratios (and with --verify, whether
    each version can be taken)."""
    from rich.console import Console
    from rich.table import Table

    from whetstone.errors import WhetstoneError

    weights, _ = _open(store, endpoint_url)
    versions = weights.versions()
    if not versions:
        typer.echo(f"no versions in {store}")
        return
    problems = weights.verify() if verify else {}
    columns = ["version", "kind", "base", "keyframe", "tensors", "raw MB", "stored MB", "ratio", "changed"]
    table = Table(*columns, *(["check"] if verify else []))
    manifests = {}
    for version in versions:
        try:
            m = manifests[version] = weights.manifest(version)
        except WhetstoneError:  # unreadable: --verify names it
            table.add_row(str(version), *["?"] * (len(columns) - 1), *(["BAD"] if verify else []))
            continue
        check = ["ok" if version not in problems else "BAD"] if verify else []
        table.add_row(
            str(m.version),
            m.kind,
            "-" if m.base is None else str(m.base),
            str(m.keyframe),
            str(len(m.tensors)),
            f"{m.raw_bytes / 1e6:.2f}",
            f"{m.encoded_bytes / 1e6:.3f}",
            f"{m.ratio:.1f}x",
            f"{m.changed / max(1, m.elements):.2%}",
            *check,
        )
    console = Console(width=140)
    console.print(table)
    stored = sum(m.encoded_bytes for m in manifests.values())
    console.print(f"latest: {weights.latest()}   versions kept: {len(versions)}   stored: {stored / 1e6:.3f} MB")
    if (unfinished := weights.withdrawal()) is not None:
        console.print(
            f"a withdrawal of versions from {unfinished} on is running or did not complete: the next "
            f"publish finishes it (or `whetstone sync withdraw {store} --from {unfinished}`)",
            highlight=False,
            soft_wrap=True,
        )
    if problems:
        for version, problem in problems.items():
            console.print(f"version {version}: {problem}", highlight=False, soft_wrap=True)
        first = min(problems)
        after = max((v for v in versions if v < first), default=-1) + 1
        raise WhetstoneError(
            f"{len(problems)} of {len(versions)} versions in {store} cannot be taken "
            f"({_listed(sorted(problems))}); repair: `whetstone sync withdraw {store} --from {first}`, "
            f"then `whetstone sync publish {store} CHECKPOINT --full` (it takes version {after})"
        )
    if verify:
        console.print(f"verified: every chunk of the {len(versions)} versions reads back intact")


@app.command()
def withdraw(
    store: str = STORE,
    first: int = typer.Option(..., "--from", help="Withdraw this version and every newer one."),
    endpoint_url: str | None = ENDPOINT,
) -> None:
    """Withdraw versions FROM.. newest (e.g. a corrupt one and the deltas built on it). The latest
    pointer moves back first; servers holding a withdrawn version re-sync from the newest keyframe.
    Then publish a keyframe: `whetstone sync publish STORE CHECKPOINT --full` takes version FROM.
    Also finishes a withdrawal that did not complete (`sync inspect` names it)."""
    from whetstone.errors import WhetstoneError

    if first < 0:  # no "newest version": every version is from -1 on, and all of them would go
        raise WhetstoneError(
            f"--from {first} is not a version number (versions count from 0, and every version from "
            f"{first} on would be withdrawn): give the first version to withdraw (`whetstone sync inspect "
            f"{store}` lists them)"
        )
    weights, _ = _open(store, endpoint_url)
    stored = weights.versions()
    # a withdrawal that did not complete is finished even where its manifests are all gone (it
    # died among the chunks): its chunks go, and its record
    if not any(v >= first for v in stored) and weights.withdrawal() is None:
        shown = f"{stored[0]}..{stored[-1]}" if stored else "none"
        raise WhetstoneError(f"no version {first} or newer in {store} to withdraw (stored versions: {shown})")
    withdrawn = weights.withdraw(first)
    latest = weights.latest()
    typer.echo(
        f"withdrew versions {_listed(withdrawn)}; latest is now {latest if latest is not None else 'none'}. "
        f"Publish a keyframe next: `whetstone sync publish {store} CHECKPOINT --full` "
        f"(version {0 if latest is None else latest + 1})"
    )


def _listed(versions: list[int]) -> str:
    return ", ".join(map(str, versions)) if len(versions) <= 6 else f"{versions[0]}..{versions[-1]} ({len(versions)})"
