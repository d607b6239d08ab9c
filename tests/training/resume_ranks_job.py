"""A 2-rank job for test_distributed.py (run under torchrun, gloo): mid-training and RL trainer
runs, one after another in one process group, as the plan file given lists them.

Before each run every rank seeds its global generators (torch's CPU one, Python's `random`,
NumPy's legacy one) with numbers of its own, as a fresh process of a resumed job has states of its
own: a rank > 0 keeps them through a resume (only rank 0 restores its own from the checkpoint).
Each rank records a fingerprint of those generators at every step's start and end, so the test
sees whether a step draws from them; it writes them to rank-N.json in the folder given.

    resume_ranks_job.py PLAN OUT    (PLAN: a JSON list of {"kind": "midtrain" | "trainer",
                                     "config": a TOML file, "stop_at_step": a step or null})
"""

import hashlib
import json
import random
import sys
from pathlib import Path

import numpy as np
import torch

import whetstone.midtrain.loop as midtrain_loop
import whetstone.trainer.loop as trainer_loop
from whetstone.config import load_config
from whetstone.midtrain.config import MidtrainConfig
from whetstone.trainer.config import TrainerConfig
from whetstone.training.distributed import torchrun_group, world
from whetstone.utils.processes import exit_process

MIDTRAIN_STEP, TRAINER_STEP = midtrain_loop._step, trainer_loop.step_once


def fingerprint() -> str:
    """The states of the global generators a training step could draw from, as one digest."""
    digest = hashlib.sha256(torch.get_rng_state().numpy().tobytes())
    digest.update(repr(random.getstate()).encode())
    kind, keys, position, *rest = np.random.get_state()
    digest.update(keys.tobytes() + repr((kind, position, *rest)).encode())
    return digest.hexdigest()[:16]


def recording(step, seen: list[str]):
    """`step` with the generators' fingerprint appended to `seen` before and after each call."""

    def step_recorded(*args, **kwargs):
        seen.append(fingerprint())
        try:
            return step(*args, **kwargs)
        finally:
            seen.append(fingerprint())

    return step_recorded


def main(plan_file: Path, out: Path) -> None:
    plan = json.loads(plan_file.read_text())
    with torchrun_group("cpu"):
        rank, _ = world()
        runs = []
        for number, run in enumerate(plan):
            seed = 1_000 * (number + 1) + 7 * rank + 1
            torch.manual_seed(seed)
            random.seed(seed)
            np.random.seed(seed)
            seen: list[str] = []
            if run["kind"] == "midtrain":
                midtrain_loop._step = recording(MIDTRAIN_STEP, seen)
                config = load_config(MidtrainConfig, run["config"])
                summary = midtrain_loop.train(config, stop_at_step=run["stop_at_step"])
            else:
                trainer_loop.step_once = recording(TRAINER_STEP, seen)
                summary = trainer_loop.run_trainer(load_config(TrainerConfig, run["config"]))
            resumed_from = summary["resumed_from"] and Path(summary["resumed_from"]).name
            runs.append(
                {"kind": run["kind"], "step": summary["step"], "resumed_from": resumed_from, "fingerprints": seen}
            )
        (out / f"rank-{rank}.json").write_text(json.dumps({"rank": rank, "runs": runs}))


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
    exit_process(0)  # as the whetstone command's ranks end
