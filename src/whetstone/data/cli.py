"""`whetstone corpus ...`: build the code corpus and print what went into it."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Optional

import typer
from rich.console import Console
from rich.table import Table

app = typer.Typer(help="The code corpus for mid-training.", no_args_is_help=True)


@app.callback()
def corpus() -> None:
    """The code corpus for mid-training."""


@app.command()
def build(
    config: Optional[Path] = typer.Argument(None, help="A TOML file of corpus settings (CorpusConfig)."),
    overrides: list[str] = typer.Option([], "--set", help="Override one setting: --set dedup.threshold=0.9"),
    rebuild: bool = typer.Option(False, help="Build again even if the cache has this corpus."),
) -> None:
    """Build the corpus (or reuse the cached build) and print its statistics."""
    from whetstone.config import load_config
    from whetstone.data import CorpusConfig, build_corpus

    started = time.perf_counter()
    corpus = build_corpus(load_config(CorpusConfig, config, overrides), rebuild=rebuild)
    Console().print(stats_table(corpus.manifest, time.perf_counter() - started))
    typer.echo(f"corpus: {corpus.path}")


def stats_table(manifest: dict[str, Any], seconds: float) -> Table:
    sources, dedup, split, tokens = manifest["sources"], manifest["dedup"], manifest["split"], manifest["tokens"]
    skipped = sources["too_small"] + sources["too_large"] + sources["undecodable"] + sources["over_cap"]
    rows = [
        ("files", f"{sources['files']:,} ({skipped:,} documents skipped: size, encoding or cap)"),
        ("duplicates removed", f"{dedup['exact_duplicates']:,} exact, {dedup['near_duplicates']:,} near"),
        ("documents train / val", f"{split['train_documents']:,} / {split['val_documents']:,}"),
        ("bytes train / val", f"{split['train_bytes']:,} / {split['val_bytes']:,}"),
        ("tokens train / val", f"{tokens['train']:,} / {tokens['val']:,}"),
        ("bytes per token", f"{manifest['bytes_per_token']:.3f}"),
        ("vocabulary", f"{manifest['tokenizer']['vocab_size']:,} ({manifest['tokenizer']['source']})"),
        ("unigram entropy", f"{manifest['unigram_entropy']:.4f} nats/token (train)"),
        ("unigram loss on val", f"{manifest['val_unigram_cross_entropy']:.4f} nats/token"),
        ("build time", f"{manifest['build_seconds']:.1f} s wall, {manifest['build_cpu_seconds']:.1f} s CPU"),
        ("this command", f"{seconds:.1f} s"),
    ]
    if manifest.get("demos"):
        demos = manifest["demos"]
        rows.append(("demonstrations", f"{demos['transcripts']:,} transcripts, {demos['tokens']:,} tokens"))
    table = Table(title="corpus", show_header=False)
    for name, value in rows:
        table.add_row(name, value)
    return table
