"""Online RL benchmark: how fast users' feedback becomes the model they are served, whether it
moves the model toward what they like, and what the loop costs their latency.

Everything runs as it would in production, on this machine: `servers` x `whetstone serve`
(following the weight store, keeping responses in a SQLite feedback store), the online loop as
its own `whetstone online` process, and simulated users sending real HTTP requests and rating
each reply by a hidden preference (default: the code the reply writes passes the task's hidden
tests, graded in a sandbox). Users ask about synth train tasks; the gate scores held-out tasks;
the preference rate is measured on other held-out tasks, never rated.

- feedback_to_deployed_s: per published update, from the feedback event that completed its
  batch (the batch is exactly `every_events` events, so its newest one completes it) until
  every server reports the new version on /metrics (sampled every 0.1 s; the event's time, the
  feedback store's clock, is read on this machine's: `store_clock_offset`); the median. Baselines
  (side by side, from the public record): Cursor Tab ships every 1.5-2 h, Composer about 5 h.
- preference_rate_before / after: liked fraction of replies to the held-out prompts before the
  loop starts and after its last update is deployed (same prompts, same seeds: paired).
- interactive_p99_ms: p99 latency of the users' requests while the loop runs, next to the p99
  of the same requests on the idle servers before it starts.

    whetstone bench online --json --model runs/default/midtrain/model
"""

from __future__ import annotations

import math
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from whetstone.errors import WhetstoneError

API_KEY = "bench-online"
CURSOR_TAB_S = 1.5 * 3600  # fastest published cycle: Cursor Tab, every 1.5-2 h
COMPOSER_S = 5 * 3600
USERS_NICE = 5
MEASURE_SEED = 1_000_000


def p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]


def store_clock_offset(store: str) -> float:
    """What to add to a time of the feedback store's clock (`FeedbackStore.now`: the loop's
    `last_rated_at`) to read it on this machine's (`time.time`: the servers' samples); not 0 for
    a database on a host whose clock is off."""
    from whetstone.store.feedback import FeedbackStore

    feedback = FeedbackStore.open(store)
    try:
        before = time.time()
        database = feedback.now()
        after = time.time()
    finally:
        feedback.close()
    return (before + after) / 2 - database


def deployed_at(samples: list[dict], servers: int) -> dict[int, float]:
    """For each version seen, the first sample time at which every server reported it or newer."""
    newest: dict[int, int] = {}
    reached: dict[int, float] = {}
    for sample in samples:
        if sample.get("up") and "weight_version" in sample:
            newest[sample["server"]] = int(sample["weight_version"])
        if len(newest) == servers:
            floor = min(newest.values())
            for version in range(floor + 1):
                reached.setdefault(version, sample["time"])
    return reached


def run(
    model: str = "runs/default/midtrain/model",
    servers: int = 2,
    updates: int = 4,
    every_events: int = 16,
    users: int = 2,
    heldout: int = 24,
    samples: int = 2,
    gate_tasks: int = 24,
    lr: float | None = None,
    max_tokens: int = 160,
    preference: str = "passes_tests",
    output_dir: str | None = None,
    logit_scale_lr: float | None = None,
) -> dict[str, Any]:
    """`preference`: `passes_tests`, or a regular expression the users like replies to match.
    `lr`, `logit_scale_lr`: the loop's learning rate and learned global sharpness (None: the
    `OnlineConfig` defaults, what `whetstone online` runs with)."""
    from whetstone.bench.pipeline import fresh_output_dir
    from whetstone.online.config import OnlineConfig

    defaults = OnlineConfig()
    lr = defaults.optimizer.lr if lr is None else lr
    logit_scale_lr = defaults.logit_scale_lr if logit_scale_lr is None else logit_scale_lr
    counts = {"servers": servers, "updates": updates, "every_events": every_events, "users": users}
    counts |= {"heldout": heldout, "samples": samples, "gate_tasks": gate_tasks, "max_tokens": max_tokens}
    if small := [f"{name} = {value}" for name, value in counts.items() if value < 1]:
        # updates = 0 would be the loop's "until stopped", with users who never stop
        raise WhetstoneError(f"bench online: {', '.join(small)}: each must be 1 or more")
    # checked here, not where the loop's config is made: that is after the servers started and measured
    if not (math.isfinite(lr) and lr > 0):
        raise WhetstoneError(f"bench online: lr = {lr}: must be a finite number > 0")
    if not (math.isfinite(logit_scale_lr) and logit_scale_lr >= 0):
        raise WhetstoneError(f"bench online: logit_scale_lr = {logit_scale_lr}: must be a finite number >= 0 (0 = off)")
    if not (Path(model) / "config.json").exists():
        raise WhetstoneError(
            f"{model} is not a Hugging Face model folder: run `whetstone run` first (it writes "
            "runs/default/midtrain/model) or pass --model"
        )
    # new or empty: the loop would resume from a previous run's state there, and its metrics be read as this run's
    work = fresh_output_dir(output_dir) if output_dir else Path(tempfile.mkdtemp(prefix="whetstone-bench-online-"))
    return _Bench(Path(model), work, servers, preference, max_tokens).run(
        updates=updates,
        every_events=every_events,
        users=users,
        heldout=heldout,
        samples=samples,
        gate_tasks=gate_tasks,
        lr=lr,
        logit_scale_lr=logit_scale_lr,
    )


class _Bench:
    def __init__(self, model: Path, work: Path, servers: int, preference: str, max_tokens: int):
        from whetstone.online.config import PreferenceConfig
        from whetstone.sync import SyncConfig

        self.model, self.work, self.servers, self.max_tokens = model, work, servers, max_tokens
        self.preference = (
            PreferenceConfig() if preference == "passes_tests" else PreferenceConfig(kind="regex", pattern=preference)
        )
        self.sync = SyncConfig(store=str(work / "weights"), poll_interval=0.2)
        self.feedback_db = str(work / "feedback.db")
        self.roles = []

    def start(self, name: str, command: str, config, health_url: str | None = None):
        from whetstone.config import write_toml
        from whetstone.utils.processes import RoleProcess

        path = self.work / "roles" / f"{name}.toml"
        write_toml(path, config)
        role = RoleProcess(
            name, [command, str(path)], self.work / "logs" / f"{name}.log", health_url=health_url, threads=1
        ).start()
        self.roles.append(role)
        return role

    def start_servers(self) -> list[str]:
        from whetstone.inference.config import EngineConfig, ServeConfig
        from whetstone.sync import WeightStore
        from whetstone.utils.processes import free_ports

        WeightStore.open(self.sync)  # the store the loop will publish to: servers follow only one that exists
        ports = free_ports(self.servers)
        started = []
        for index, port in enumerate(ports):
            config = ServeConfig(
                model_path=str(self.model),
                port=port,
                threads=1,
                auth_token=API_KEY,
                sync=self.sync,
                feedback={"store": self.feedback_db},
                engine=EngineConfig(max_batch=8),
            )
            started.append(self.start(f"serve-{index}", "serve", config, f"http://127.0.0.1:{port}/health"))
        for role in started:
            role.wait_healthy(180)
        return [f"http://127.0.0.1:{port}/v1" for port in ports]

    def start_loop(self, updates: int, every_events: int, gate_tasks: int, lr: float, logit_scale_lr: float):
        from whetstone.envs.tasks.registry import TasksConfig
        from whetstone.envs.tasks.synth import SynthConfig
        from whetstone.online.config import OnlineConfig

        config = OnlineConfig.model_validate(
            {
                "model_path": str(self.model),
                "feedback_store": self.feedback_db,
                "sync": self.sync.model_dump(),
                "output_dir": str(self.work / "online"),
                "max_updates": updates,
                "poll_interval": 0.1,
                "trigger": {"every_events": every_events, "min_events": every_events, "max_events": every_events},
                "optimizer": {"lr": lr, "warmup_steps": 0, "min_lr_ratio": 1.0, "weight_decay": 0.0},
                "logit_scale_lr": logit_scale_lr,
                "gate": {
                    "tasks": TasksConfig(synth=SynthConfig(split="heldout", count=gate_tasks, seed=101)).model_dump(),
                    "metric": self.preference.model_dump(),
                    "max_tokens": self.max_tokens,
                },
            }
        )
        role = self.start("online", "online", config)
        ready = self.work / "online" / "config.toml"  # written once the loop has scored the deployed version
        while not ready.exists():
            role.check()
            if not role.running:
                raise WhetstoneError(f"the online loop exited before it started; see {role.log_path}")
            time.sleep(0.2)
        return role

    def measure(self, urls: list[str], tasks: list, samples: int, users: int) -> list:
        """Held-out replies, judged; before and after use the same seeds (paired comparison)."""
        from whetstone.online.preferences import make_preference
        from whetstone.online.simulator import UserSimulator

        simulator = UserSimulator(
            urls,
            self.model.name,
            API_KEY,
            make_preference(self.preference),
            max_tokens=self.max_tokens,
            seed=MEASURE_SEED,
        )
        try:
            return simulator.judge(tasks, samples, users)
        finally:
            simulator.close()

    def wait_for_version(self, version: int, timeout_s: float = 120.0) -> None:
        from whetstone.utils.metrics import read_metrics

        deadline = time.monotonic() + timeout_s
        while version not in deployed_at(read_metrics(self.work / "servers.jsonl"), self.servers):
            if time.monotonic() > deadline:
                raise WhetstoneError(f"the servers did not all reach version {version} within {timeout_s:g} s")
            time.sleep(0.2)

    def run(
        self,
        *,
        updates: int,
        every_events: int,
        users: int,
        heldout: int,
        samples: int,
        gate_tasks: int,
        lr: float,
        logit_scale_lr: float,
    ) -> dict[str, Any]:
        from whetstone.envs.tasks.synth import SynthConfig, generate
        from whetstone.online.preferences import make_preference
        from whetstone.online.simulator import UserSimulator
        from whetstone.run.monitor import ServerSampler
        from whetstone.utils.metrics import read_metrics

        user_tasks = generate(SynthConfig(count=200, split="train", seed=7))
        heldout_tasks = generate(SynthConfig(count=heldout, split="heldout", seed=202))
        metrics_path = self.work / "online" / "metrics.jsonl"
        try:
            urls = self.start_servers()
            clock_offset_s = store_clock_offset(self.feedback_db)  # the servers have created the store
            # The users' own work (their sandboxed grading) stands for other machines: it must not
            # take the servers' cores. The loop (started after) inherits this and adds its own nice.
            os.nice(USERS_NICE)
            simulator = UserSimulator(
                urls, self.model.name, API_KEY, make_preference(self.preference), max_tokens=self.max_tokens
            )
            idle = simulator.run(user_tasks[:20], users=1, requests=20, give_feedback=False)
            before = self.measure(urls, heldout_tasks, samples, users)
            loop = self.start_loop(updates, every_events, gate_tasks, lr, logit_scale_lr)
            with ServerSampler(urls, self.work / "servers.jsonl", interval_s=0.1):
                started = time.time()
                during = simulator.run(user_tasks, users=users, until=lambda: not loop.running)
                loop.check()
                records = read_metrics(metrics_path)
                self.wait_for_version(max([r["version"] for r in records] + [0]))
            after = self.measure(urls, heldout_tasks, samples, users)
            simulator.close()
        finally:
            for role in reversed(self.roles):
                role.stop()
        server_samples = read_metrics(self.work / "servers.jsonl")
        return summarize(records, server_samples, self.servers, idle, during, before, after, clock_offset_s) | {
            "model": str(self.model),
            "servers": self.servers,
            "users": users,
            "every_events": every_events,
            "heldout_prompts": heldout,
            "samples_per_prompt": samples,
            "gate_tasks": gate_tasks,
            "lr": lr,
            "logit_scale_lr": logit_scale_lr,
            "preference": self.preference.kind if self.preference.kind != "regex" else self.preference.pattern,
            "loop_wall_s": time.time() - started,
            "output_dir": str(self.work),
        }


def paired_change(before: list, after: list) -> dict[str, Any]:
    """How the same held-out requests (task, seed) fared before and after: counts of replies
    liked by both, by neither, newly liked (`gained`) and no longer liked (`lost`), and the exact
    two-sided sign test on gained against lost (the chance of a split at least this uneven if
    the updates changed nothing)."""
    liked_before = {(e.task_id, e.seed): e.liked for e in before}
    pairs = [(liked_before[(e.task_id, e.seed)], e.liked) for e in after if (e.task_id, e.seed) in liked_before]
    gained = sum(not b and a for b, a in pairs)
    lost = sum(b and not a for b, a in pairs)
    changed = gained + lost
    tail = sum(math.comb(changed, k) for k in range(max(gained, lost), changed + 1)) / 2**changed if changed else 1.0
    return {
        "pairs": len(pairs),
        "both": sum(b and a for b, a in pairs),
        "neither": sum(not (b or a) for b, a in pairs),
        "gained": gained,
        "lost": lost,
        "sign_test_p": min(1.0, 2 * tail),
    }


def summarize(
    records: list[dict],
    server_samples: list[dict],
    servers: int,
    idle: list,
    during: list,
    before: list,
    after: list,
    clock_offset_s: float,
) -> dict[str, Any]:
    """The benchmark's figures from the loop's metrics, the servers' samples and the users'
    exchanges. `clock_offset_s`: `store_clock_offset`, which puts the feedback times of the loop's
    records on the samples' clock."""
    from whetstone.online.simulator import liked_share

    reached = deployed_at(server_samples, servers)
    published = [r for r in records if r["decision"] == "published"]
    latencies = [
        reached[r["version"]] - (r["last_rated_at"] + clock_offset_s) for r in published if r["version"] in reached
    ]
    median = statistics.median(latencies) if latencies else None
    idle_p99, busy_p99 = p99([e.latency_s for e in idle]) * 1000, p99([e.latency_s for e in during]) * 1000
    return {
        "feedback_to_deployed_s": median,
        "feedback_to_deployed_s_each": latencies,
        "goal_s": 60,
        "speedup_vs_cursor_tab": CURSOR_TAB_S / median if median else None,
        "speedup_vs_composer": COMPOSER_S / median if median else None,
        "preference_rate_before": liked_share(before),
        "preference_rate_after": liked_share(after),
        "preference_change": paired_change(before, after),
        "interactive_p99_ms": busy_p99,
        "interactive_p99_idle_ms": idle_p99,
        "interactive_p99_ratio": busy_p99 / idle_p99,
        "updates": len(records),
        "published": len(published),
        "discarded": sum(r["decision"] == "discarded" for r in records),
        "skipped": sum(r["decision"] == "skipped" for r in records),
        "reasons": [r["reason"] for r in records],
        "gate_scores": [r.get("gate_score") for r in records],
        "deployed_scores": [r.get("deployed_score") for r in records],
        "train_s_median": statistics.median([r["train_s"] for r in records if "train_s" in r] or [0.0]),
        "eval_s_median": statistics.median([r["eval_s"] for r in records if "eval_s" in r] or [0.0]),
        "requests_during_loop": len(during),
        "liked_during_loop": sum(e.liked for e in during) / max(1, len(during)),
    }


if __name__ == "__main__":  # `whetstone bench online`, options included
    from whetstone.bench.cli import run_as_module

    run_as_module("online")
