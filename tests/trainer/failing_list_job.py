"""A 2-rank trainer job for test_distributed.py (run under torchrun, gloo) in which rank 0's
listing of the batch store fails while it waits for a batch (an object store's request that
fails), as only fault injection makes a local store's listing fail: the first listing (at the
start) succeeds, the next (the report of a wait, due at once here) raises on rank 0.

Each rank records what `run_trainer` raised in rank-N.json beside the config file given."""

import json
import os
import sys
from pathlib import Path

from whetstone.config import load_config
from whetstone.trainer import loop
from whetstone.trainer.config import TrainerConfig
from whetstone.training.distributed import world
from whetstone.utils.processes import exit_process


def main(config_file: Path) -> None:
    listings = 0
    listed = loop.batch_indices

    def batch_indices(store):
        nonlocal listings
        listings += 1
        if world()[0] == 0 and listings > 1:
            raise OSError(f"listing {store!r} failed (injected)")
        return listed(store)

    loop.batch_indices = batch_indices
    loop.IDLE_REPORT_S = 0.0
    raised = None
    try:
        loop.run_trainer(load_config(TrainerConfig, config_file, []))
    except Exception as err:
        raised = f"{type(err).__name__}: {err}"
    rank = int(os.environ["RANK"])
    (config_file.parent / f"rank-{rank}.json").write_text(json.dumps({"rank": rank, "raised": raised}))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
    exit_process(0)  # as the whetstone command's ranks end
