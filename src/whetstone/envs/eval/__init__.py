"""Evaluation: an endpoint over a task set through the agent harness, n samples per task, with
pass@k (unbiased estimator), rewards, cheat flags, turns and tokens in a JSON + Markdown report."""

from whetstone.envs.eval.config import EvalConfig
from whetstone.envs.eval.passk import mean_pass_at_k, pass_at_k
from whetstone.envs.eval.report import build_report, render_markdown, solved
from whetstone.envs.eval.run import evaluate, load_eval_tasks

__all__ = [
    "EvalConfig",
    "build_report",
    "evaluate",
    "load_eval_tasks",
    "mean_pass_at_k",
    "pass_at_k",
    "render_markdown",
    "solved",
]
