"""`whetstone bench ...`: each benchmark measures whetstone side by side with its baseline in one
run and prints one JSON object (`--json`) or a readable table. Figures go to docs/benchmarks.md."""

from __future__ import annotations

import importlib
import json

import typer
from rich.console import Console
from rich.table import Table

app = typer.Typer(help="Benchmarks against the named baselines, side by side in one run.", no_args_is_help=True)

JSON = typer.Option(False, "--json", help="Print one JSON object and nothing else on stdout.")


def _emit(result: dict, as_json: bool, title: str) -> None:
    if as_json:
        print(json.dumps(result, indent=2, sort_keys=True))
        return
    table = Table(title=title)
    table.add_column("metric")
    table.add_column("value")
    for key, value in result.items():
        shown = (
            json.dumps(value)
            if isinstance(value, (list, dict))
            else (f"{value:.4g}" if isinstance(value, float) else str(value))
        )
        table.add_row(key, shown)
    Console().print(table)


def _bench(name: str):
    return importlib.import_module(f"whetstone.bench.{name}")


def run_as_module(name: str) -> None:
    """`python -m whetstone.bench.NAME ARGS`: `whetstone bench NAME ARGS`, the same command with
    the same options, help and error handling."""
    import sys

    from whetstone.cli import main

    main(["bench", name, *sys.argv[1:]])


@app.command()
def sync(
    as_json: bool = JSON,
    repeats: int = typer.Option(5, help="Timing repeats per case (best is kept)."),
    rl_store: list[str] = typer.Option(
        ["runs/default/weights"],
        "--rl-store",
        help="An RL weight-store directory (`whetstone run` writes runs/<name>/weights); repeatable.",
    ),
    rl_pairs: int = typer.Option(5, min=1, help="Newest pairs of consecutive versions measured per store (medians)."),
) -> None:
    """Delta codec size and speed on real RL-like steps and RL runs vs XOR+zstd, and publish->subscriber fan-out."""
    _emit(_bench("sync").run(repeats=repeats, rl_stores=rl_store, rl_pairs=rl_pairs), as_json, "weight sync")


@app.command()
def sandbox(
    as_json: bool = JSON,
    samples: int = typer.Option(200, help="Sequential sandboxes timed for p50/p99."),
    duration_s: float = typer.Option(10.0, help="Seconds of all-cores throughput measurement."),
) -> None:
    """Sandbox start-to-exit latency and throughput vs an unsandboxed process."""
    _emit(_bench("sandbox").run(samples=samples, duration_s=duration_s), as_json, "sandbox")


@app.command()
def train(
    as_json: bool = JSON,
    steps: int = typer.Option(24, help="Timed optimizer steps per implementation."),
    threads: int = typer.Option(2, help="torch threads for both implementations."),
    dtype: str = typer.Option(
        "auto",
        help="Compute dtype: float32, bfloat16, or auto (mid-training's default: bfloat16 where the CPU "
        "multiplies it natively).",
    ),
) -> None:
    """Training tokens/s of the tiny MoE: whetstone vs transformers' Qwen3-MoE, same batches."""
    _emit(_bench("train").run(steps=steps, threads=threads, dtype=dtype), as_json, "training throughput")


@app.command()
def inference(
    as_json: bool = JSON,
    threads: int = typer.Option(1, help="torch threads for both engines."),
    new_tokens: int = typer.Option(128, help="Tokens generated per request."),
) -> None:
    """Generation tokens/s vs transformers' generate, interactive latency under load, swap pause."""
    _emit(_bench("inference").run(threads=threads, new_tokens=new_tokens), as_json, "inference")


@app.command()
def pipeline(
    as_json: bool = JSON,
    steps: int = typer.Option(
        24, help="Trainer steps per side (step 0 fills the pipeline: fewer steps weigh it more)."
    ),
    group_size: int = typer.Option(4, help="Rollouts per task (TRL's num_generations)."),
    groups_per_batch: int = typer.Option(2, help="Groups per step: samples per step = group size x groups."),
    max_tokens: int = typer.Option(64, help="Completion tokens of a rollout (one turn)."),
    tasks: int = typer.Option(16, help="Coin tasks (synth train tasks that give reward variance)."),
    model: str = typer.Option("", "--model", help="A mid-trained HF folder; default: the tiny MoE, random weights."),
    model_size: str = typer.Option(
        "tiny", help="Random model when no --model: tiny (1.9M, the default run's) or default (8.1M, ModelConfig())."
    ),
    trl: bool = typer.Option(True, "--trl/--no-trl", help="Also run TRL's GRPOTrainer."),
    placement: str = typer.Option(
        "balanced",
        help="balanced: CPU quotas sized by each side's measured share of the "
        "work; split: the trainer on core 0, the rollout side on the others "
        "(both: roles on separate hardware); shared: every role on every core.",
    ),
    servers: int = typer.Option(1, help="`whetstone serve` processes of every whetstone side."),
    output_dir: str = typer.Option(
        "", help="Keep the roles' configs, logs and metrics here, a new or empty folder (default: a temp folder)."
    ),
) -> None:
    """Samples/s of asynchronous RL vs the synchronous baseline and TRL's GRPOTrainer; busy fractions."""
    result = _bench("pipeline").run(
        steps=steps,
        group_size=group_size,
        groups_per_batch=groups_per_batch,
        max_tokens=max_tokens,
        tasks=tasks,
        model=model or None,
        model_size=model_size,
        trl=trl,
        placement=placement,
        servers=servers,
        output_dir=output_dir or None,
    )
    _emit(result, as_json, "RL pipeline")


@app.command()
def online(
    as_json: bool = JSON,
    model: str = typer.Option("runs/default/midtrain/model", "--model", help="The served HF folder (mid-trained)."),
    servers: int = typer.Option(2, help="`whetstone serve` processes."),
    updates: int = typer.Option(4, help="Online updates (published or discarded) before the loop stops."),
    every_events: int = typer.Option(16, help="Feedback events per update."),
    users: int = typer.Option(2, help="Concurrent simulated users."),
    heldout: int = typer.Option(24, help="Held-out prompts of the preference rate."),
    samples: int = typer.Option(2, help="Replies per held-out prompt."),
    gate_tasks: int = typer.Option(24, help="Held-out tasks of the deploy gate."),
    lr: float = typer.Option(None, help="Learning rate of the online updates (default: `whetstone online`'s)."),
    logit_scale_lr: float = typer.Option(
        None, help="Learning rate of the loop's learned logit scale, 0 = off (default: `whetstone online`'s)."
    ),
    preference: str = typer.Option("passes_tests", help="Users' hidden taste: passes_tests, or a regex replies match."),
    max_tokens: int = typer.Option(160, help="Completion budget of every reply (users' and the gate's)."),
    output_dir: str = typer.Option(
        "", help="Keep configs, logs and metrics here, a new or empty folder (default: a temp folder)."
    ),
) -> None:
    """Feedback -> deployed seconds, held-out preference before/after, interactive p99 during the loop."""
    result = _bench("online").run(
        model=model,
        servers=servers,
        updates=updates,
        every_events=every_events,
        users=users,
        heldout=heldout,
        samples=samples,
        gate_tasks=gate_tasks,
        lr=lr,
        logit_scale_lr=logit_scale_lr,
        preference=preference,
        max_tokens=max_tokens,
        output_dir=output_dir or None,
    )
    _emit(result, as_json, "online RL")


@app.command()
def fleet(
    as_json: bool = JSON,
    servers: list[int] = typer.Option([1, 2, 4], "--servers", help="Server counts of the scaling case; repeatable."),
    rollouts_per_server: int = typer.Option(8, help="Timed rollouts per server in the scaling case."),
    behind: int = typer.Option(10, help="Versions the store is ahead of a joining server's weights."),
    loss_rollouts: int = typer.Option(16, help="Rollouts of the cluster-loss case."),
    output_dir: str = typer.Option(
        "", help="Keep the servers' configs and logs here, a new or empty folder (default: a temp folder)."
    ),
) -> None:
    """The elastic inference fleet: rollouts/s with 1, 2, 4 servers, a late server's time to its
    first rollout on the current weights, and rollouts lost when a cluster dies."""
    result = _bench("fleet").run(
        sizes=servers,
        rollouts_per_server=rollouts_per_server,
        behind=behind,
        loss_rollouts=loss_rollouts,
        output_dir=output_dir or None,
    )
    _emit(result, as_json, "inference fleet")


@app.command()
def consistency(
    as_json: bool = JSON,
    threads: int = typer.Option(1, help="torch threads for the engine and the trainer (each role's own core)."),
    dtype: str = typer.Option("float32", help="Compute dtype of both sides: float32 or bfloat16."),
    rounds: int = typer.Option(5, help="Interleaved timing rounds per mode."),
) -> None:
    """Engine vs trainer logprob and routing mismatch, fast vs batch-invariant numerics, and their cost."""
    _emit(_bench("consistency").run(threads=threads, dtype=dtype, rounds=rounds), as_json, "numerics consistency")


@app.command()
def gpu(
    as_json: bool = JSON,
    device: str = typer.Option("auto", help="auto (CUDA when present, else the CPU), cpu, cuda or cuda:N."),
    model: str = typer.Option(
        "gpu", "--model", help="gpu: the 380M MoE; tiny: the default run's 1.9M (a CPU smoke run)."
    ),
    sections: str = typer.Option("train,inference,rl,consistency", help="Comma-separated sections to run."),
    threads: int = typer.Option(0, help="torch threads of this process (0 = every core)."),
    train_batch: int = typer.Option(8, help="Training batch rows."),
    train_seq_len: int = typer.Option(1024, help="Training tokens per row."),
    train_steps: int = typer.Option(8, help="Timed training steps per implementation."),
    train_warmup: int = typer.Option(2, help="Untimed training steps before them."),
    batch: list[int] = typer.Option([16, 64], "--batch", help="Generation batch size; repeatable."),
    prompt_tokens: int = typer.Option(64, help="Prompt tokens of every generated row."),
    new_tokens: int = typer.Option(128, help="Tokens generated per row."),
    repeats: int = typer.Option(1, help="Timed generate calls per contender and batch size (after the first)."),
    swaps: int = typer.Option(
        3, help="Weight versions published while the engine decodes (swap pause; 0 = not measured)."
    ),
    rl_steps: int = typer.Option(6, help="Trainer steps of the RL run."),
    group_size: int = typer.Option(4, help="Rollouts per task in the RL run."),
    groups_per_batch: int = typer.Option(2, help="Groups per RL step."),
    rl_max_tokens: int = typer.Option(64, help="Completion tokens of an RL rollout (one turn)."),
    rl_tasks: int = typer.Option(8, help="Coin tasks of the RL run."),
    rl_numerics: str = typer.Option(
        "fast", help="The RL run's numerics: fast or invariant (the trainer's and server's)."
    ),
    rl_synchronous: bool = typer.Option(
        False, help="Run RL on-policy (synchronous): every step's mismatch is then numerics alone."
    ),
    consistency_requests: int = typer.Option(16, help="Sequences of the consistency section."),
    consistency_tokens: int = typer.Option(128, help="Prompt tokens, and generated tokens, per consistency sequence."),
    output_dir: str = typer.Option(
        "", help="Keep the RL run's configs, logs and metrics here (default: a temp folder)."
    ),
) -> None:
    """whetstone vs transformers on one accelerator: training, generation (default and compiled static
    cache), swap pause, a short RL run with its trainer-vs-engine mismatch, and the engine against
    the trainer in fast and invariant numerics. Progress on stderr;
    exit 1 (after the JSON) when a section failed."""
    result = _bench("gpu").run(
        device=device,
        model=model,
        sections=[s.strip() for s in sections.split(",") if s.strip()],
        threads=threads,
        train_batch=train_batch,
        train_seq_len=train_seq_len,
        train_steps=train_steps,
        train_warmup=train_warmup,
        batches=batch,
        prompt_tokens=prompt_tokens,
        new_tokens=new_tokens,
        repeats=repeats,
        swaps=swaps,
        rl_steps=rl_steps,
        group_size=group_size,
        groups_per_batch=groups_per_batch,
        rl_max_tokens=rl_max_tokens,
        rl_tasks=rl_tasks,
        rl_numerics=rl_numerics,
        rl_synchronous=rl_synchronous,
        consistency_requests=consistency_requests,
        consistency_tokens=consistency_tokens,
        output_dir=output_dir or None,
    )
    _emit(result, as_json, "GPU")
    if result["failed"]:
        raise typer.Exit(1)


@app.command()
def vllm(
    as_json: bool = JSON,
    tasks: int = typer.Option(4, help="Coin tasks (synth train tasks that give reward variance)."),
    samples: int = typer.Option(2, help="Rollouts per task."),
    max_tokens: int = typer.Option(48, help="Completion tokens of a rollout (one turn)."),
    concurrency: int = typer.Option(4, help="Rollouts in flight at once."),
    versions: int = typer.Option(3, help="Versions published to time publish -> serving (median)."),
    vllm_python: str = typer.Option("", help="The vLLM environment's python (default: $WHETSTONE_VLLM_PYTHON)."),
) -> None:
    """Rollouts/s, trainer-vs-engine mismatch and publish->serving time: whetstone's engine vs vLLM."""
    result = _bench("vllm").run(
        tasks=tasks,
        samples=samples,
        max_tokens=max_tokens,
        concurrency=concurrency,
        versions=versions,
        vllm_python=vllm_python,
    )
    _emit(result, as_json, "whetstone vs vLLM as rollout engine")
