"""A role's ranks as processes of this machine (`placement.trainer_ranks`, `midtrain_ranks`):
torchrun's environment, one role's exit code and stop, the config and preflight checks, and the
tiny run mid-trained and trained by 2 gloo ranks each."""

import json
import os
import sys
import time

import pytest
import torch

from tests.run.run_support import tiny_run
from whetstone.errors import ConfigError, WhetstoneError
from whetstone.run.local_ranks import LocalRankGroup
from whetstone.run.pipeline import rank_threads, run_pipeline
from whetstone.run.preflight import _rank_gpus
from whetstone.utils.metrics import read_metrics

# each rank: its environment into rank<R>.json, then the exit `behave` gives its rank (none: wait)
RANK = """
import json, os, pathlib, signal, sys, time
rank = int(os.environ["RANK"])
keys = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "OMP_NUM_THREADS")
pathlib.Path(sys.argv[1], f"rank{rank}.json").write_text(json.dumps({k: os.environ[k] for k in keys}))
signal.signal(signal.SIGTERM, lambda *_: sys.exit(ON_TERM.get(rank, 0)))  # a trainer rank: ends cleanly on SIGTERM
code = BEHAVE.get(rank)
if code is not None:
    time.sleep(0.5)
    sys.exit(code)
time.sleep(600)
"""


def group(tmp_path, behave: dict[int, int], size: int = 3, on_term: dict[int, int] | None = None) -> LocalRankGroup:
    script = RANK.replace("BEHAVE", repr(behave)).replace("ON_TERM", repr(on_term or {}))
    command = [sys.executable, "-c", script, str(tmp_path)]
    return LocalRankGroup("trainer", ["unused"], tmp_path / "logs" / "trainer.log", size, threads=2, command=command)


def wait_for(condition, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_ranks_get_torchruns_environment_and_end_together(tmp_path):
    ranks = group(tmp_path, {}).start()
    wait_for(lambda: all((tmp_path / f"rank{r}.json").exists() for r in range(3)))
    envs = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(3)]
    assert [(e["RANK"], e["LOCAL_RANK"], e["WORLD_SIZE"], e["LOCAL_WORLD_SIZE"]) for e in envs] == [
        (str(r), str(r), "3", "3") for r in range(3)
    ]
    assert {(e["MASTER_ADDR"], e["MASTER_PORT"], e["OMP_NUM_THREADS"]) for e in envs} == {
        ("127.0.0.1", envs[0]["MASTER_PORT"], "2")
    }
    assert ranks.running and ranks.returncode is None
    assert ranks.stop(grace_s=10) == 0 and not any(rank.running for rank in ranks.ranks)  # SIGTERM to all at once
    assert (tmp_path / "logs" / "trainer-rank2.log").exists()


def test_a_failed_rank_ends_the_others_and_is_named(tmp_path):
    ranks = group(tmp_path, {1: 3}).start()
    assert ranks.wait(timeout_s=60) == 3
    assert not any(rank.running for rank in ranks.ranks)  # rank 0 and 2 would wait in a collective for ever
    with pytest.raises(WhetstoneError, match=r"trainer rank 1 exited with code 3; end of .*trainer-rank1.log"):
        ranks.check()


def test_a_rank_that_fails_its_stop_is_named(tmp_path):
    ranks = group(tmp_path, {}, on_term={2: 5})
    with pytest.raises(WhetstoneError, match="trainer was never started"):
        ranks.wait()
    ranks.start()
    wait_for(lambda: all((tmp_path / f"rank{r}.json").exists() for r in range(3)))
    assert ranks.stop(grace_s=10) == 5
    with pytest.raises(WhetstoneError, match=r"trainer rank 2 exited with code 5; end of .*trainer-rank2.log"):
        ranks.check()


def test_every_rank_done_is_the_group_done(tmp_path):
    ranks = group(tmp_path, {0: 0, 1: 0}, size=2).start()
    assert ranks.wait(timeout_s=60) == 0
    ranks.check()


def test_ranks_share_their_roles_threads():
    assert (rank_threads(4, 2), rank_threads(1, 2), rank_threads(0, 2, cores=6)) == (2, 1, 3)  # 0: its cores
    usable = os.sched_getaffinity(0)
    try:
        os.sched_setaffinity(0, {min(usable)})  # a run pinned to one core: its ranks share that one
        assert rank_threads(0, 1) == 1
    finally:
        os.sched_setaffinity(0, usable)


def test_local_ranks_are_checked_when_the_config_loads(tmp_path):
    with pytest.raises(
        ConfigError, match=r"placement.trainer_ranks = 2 places ranks on this machine .*ray.trainer_ranks"
    ):
        tiny_run(tmp_path, 'placement.backend="ray"', "placement.trainer_ranks=2")
    with pytest.raises(ConfigError, match=r"trainer_device = 'cuda:1' with placement.trainer_ranks = 2: rank i"):
        tiny_run(tmp_path, 'placement.trainer_device="cuda:1"', "placement.trainer_ranks=2")
    with pytest.raises(
        ConfigError, match=r"midtrain.run.batch_size \(4\) must be a multiple of placement.midtrain_ranks"
    ):
        tiny_run(tmp_path, "placement.midtrain_ranks=3")


def test_ranks_on_gpus_need_as_many_gpus_and_the_trainers_to_themselves(tmp_path, monkeypatch):
    config = tiny_run(tmp_path, "placement.trainer_ranks=2", "placement.midtrain_ranks=4", "midtrain.run.batch_size=8")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 3)
    resolved = {
        "midtrain.run.device": torch.device("cuda", 0),
        "placement.trainer_device": torch.device("cuda", 0),
        "placement.server_devices[0]": torch.device("cuda", 1),
    }
    assert list(_rank_gpus(config, resolved)) == [
        "placement.midtrain_ranks: 4 ranks take a GPU each, and this machine has 3",
        "placement.server_devices[0] = 'auto' is cuda:1, which trainer rank 1 takes whole "
        "(placement.trainer_ranks = 2): put the servers on cuda:2 and up",
    ]
    resolved["placement.server_devices[0]"] = torch.device("cuda", 2)
    resolved["midtrain.run.device"] = torch.device("cpu")  # gloo ranks: no GPU to count
    assert list(_rank_gpus(config, resolved)) == []


@pytest.mark.timeout(300)
def test_the_tiny_run_mid_trains_and_trains_on_two_local_ranks(tmp_path, capfd):
    summary = run_pipeline(tiny_run(tmp_path, "placement.midtrain_ranks=2", "placement.trainer_ranks=2"))
    run = tmp_path / "runs" / "tiny"
    midtrain = summary["stages"]["midtrain"]
    assert midtrain["finished"] and midtrain["world_size"] == 2 and (run / "logs" / "midtrain-rank1.log").exists()
    err = capfd.readouterr().err.splitlines()  # the ranks' progress, as mid-training in the run's process shows it
    assert any(line.startswith("midtrain midtrain: 1,024/1,024 tok (100%)") for line in err), err
    steps = read_metrics(run / "trainer" / "metrics.jsonl")
    assert [(s["step"], s["version"], s["world_size"]) for s in steps] == [(0, 1, 2), (1, 2, 2)]
    assert (run / "logs" / "trainer-rank1.log").exists() and summary["heldout_pass1_after"] is not None
