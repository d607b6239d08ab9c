"""The tiny `whetstone run` config shared by the tests that build or run a pipeline.

The tiny model never solves a task, so the tasks are coin tasks (tests/orchestrator): synth tasks
whose repository already holds the solution, plus a hidden test that passes half the time, so
groups get rewards that differ and batches fill. No synth demonstrations: the tiny config's rows
are shorter than a transcript's prompt (mid-training with demonstrations is tested in
tests/midtrain); the trainer's anchor gets a file of one short transcript instead.
"""

from tests.midtrain.midtrain_support import TINY, write_corpus
from tests.orchestrator.orchestrator_support import coin_tasks
from whetstone.config import load_config
from whetstone.envs.tasks import write_tasks
from whetstone.rl.demos import write_demos
from whetstone.run.config import PipelineConfig


def tiny_settings(tmp_path, *overrides: str) -> list[str]:
    """The tiny run as `--set` overrides (its corpus, tasks and demonstrations written under tmp_path)."""
    code = write_corpus(tmp_path)
    tasks = tmp_path / "coin.jsonl"
    write_tasks(coin_tasks(4), tasks)
    demos = tmp_path / "demos.jsonl"
    write_demos(demos, [[{"role": "user", "content": "fix it"}, {"role": "assistant", "content": "done"}]])
    return [
        *(f"midtrain.{line}" for line in TINY),
        f'midtrain.data.directories=[{{path="{code}"}}]',
        f'midtrain.data.cache_dir="{tmp_path / "cache"}"',
        "demos.count=0",
        f'output_dir="{tmp_path / "runs"}"',
        'name="tiny"',
        "harness.max_turns=2",
        "harness.max_turn_tokens=12",
        "harness.max_tool_tokens=128",
        "harness.max_calls_per_turn=2",
        "harness.summary_tokens=16",
        "harness.train_cut_off_calls=true",
        "servers.serve.engine.max_batch=8",
        "rl.steps=2",
        "rl.trainer.sync.poll_interval=0.1",
        "rl.trainer.poll_interval=0.1",
        f'rl.trainer.demos_path="{demos}"',
        "rl.trainer.demo_coef=1.0",
        "rl.trainer.demo_rows=1",
        f'rl.orchestrator.tasks.source="{tasks}"',
        "rl.orchestrator.validate_tasks=false",
        "rl.orchestrator.group_size=2",
        "rl.orchestrator.groups_per_batch=1",
        "rl.orchestrator.rollout.concurrency=4",
        "rl.orchestrator.poll_interval_s=0.1",
        "rl.orchestrator.health_interval_s=0.2",
        f'eval.tasks.source="{tasks}"',
        "eval.validate_tasks=false",
        "eval.samples=2",
        "eval.temperatures=[0.5]",
        *overrides,
    ]


def tiny_run(tmp_path, *overrides: str) -> PipelineConfig:
    return load_config(PipelineConfig, None, tiny_settings(tmp_path, *overrides))
