"""`whetstone run` on a real Ray cluster: three Ray nodes on this machine (separate raylet
processes, `ray.cluster_utils.Cluster`), CPU only. The head node takes the trainer and the
orchestrator; two nodes offer one cluster label each, `cluster:eu` and `cluster:us`, and take one
inference server each. One server actor is killed while the run goes on."""

import sys
import threading
import time

import httpx
import pytest

from tests.run.run_support import tiny_run
from whetstone.errors import ConfigError
from whetstone.fleet import FleetRegistry
from whetstone.rl.batch import batch_from_bytes
from whetstone.run.pipeline import Pipeline
from whetstone.run.preflight import check_run_config
from whetstone.store import LocalStore
from whetstone.utils.metrics import read_metrics

RAY = ['placement.backend="ray"', 'placement.ray.server_clusters=["eu", "us"]', "rl.steps=3"]


def test_a_ray_run_without_ray_installed_is_refused_before_mid_training(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray fails, as where it is not installed
    with pytest.raises(ConfigError, match=r"needs Ray: pip install 'whetstone\[ray\]'"):
        check_run_config(tiny_run(tmp_path, *RAY).resolved())


@pytest.fixture
def ray_cluster():
    cluster_utils = pytest.importorskip("ray.cluster_utils")
    cluster = cluster_utils.Cluster(initialize_head=True, head_node_args={"num_cpus": 2})
    try:
        cluster.add_node(num_cpus=1, resources={"cluster:eu": 1})
        cluster.add_node(num_cpus=1, resources={"cluster:us": 1})
        yield cluster
    finally:
        import ray

        ray.shutdown()
        cluster.shutdown()


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_tiny_run_on_three_ray_nodes_survives_a_killed_server(tmp_path, ray_cluster):
    import ray

    config = tiny_run(tmp_path, *RAY, f'placement.ray.address="{ray_cluster.address}"')
    pipeline = Pipeline(config)
    run = tmp_path / "runs" / "tiny"
    batches = LocalStore(run / "batches")
    killed: dict = {}

    def kill_a_server_mid_run():
        """Once batch 0 is put, kill server 1's actor (its process goes with it)."""
        while not batches.exists("batches/0000000000.batch"):
            if killed.get("stop"):
                return
            time.sleep(0.2)
        victim = next(role for role in pipeline.roles if role.name == "serve-1")
        killed["url"] = victim.url
        ray.kill(victim.handle, no_restart=True)

    killer = threading.Thread(target=kill_a_server_mid_run, daemon=True)
    killer.start()
    try:
        summary = pipeline.run()
    finally:
        killed["stop"] = True
        killer.join()

    assert "url" in killed, "the run ended before a server could be killed"
    with pytest.raises(httpx.HTTPError):  # the role died with its actor
        httpx.get(killed["url"].removesuffix("/v1") + "/health", timeout=5)
    steps = read_metrics(run / "trainer" / "metrics.jsonl")
    assert [s["step"] for s in steps] == [0, 1, 2]  # every batch trained once, none lost
    keys = batches.list("batches/")
    assert len(keys) == 3
    for key in keys:
        meta = batch_from_bytes(batches.get(key), key).meta
        assert "dropped_failed" not in meta["groups"], meta  # no rollout lost to the dead server
    records = read_metrics(run / "orchestrator" / "metrics.jsonl")
    # per cluster from the first batch on (the dead server leaves the pool at its next failed call,
    # or once its heartbeat is stale: maybe after the last batch)
    assert {"cluster_eu_servers", "cluster_us_servers"} <= set(records[0]) and records[0]["cluster_eu_servers"] == 1
    placed = {role.name: role.url for role in pipeline.roles if role.url}
    assert set(placed) == {"serve-0", "serve-1"}
    # the server stopped at the end removed its record; the killed one's went stale (Ray SIGKILLs
    # an actor's children, so it could not say goodbye) and was dropped all the same
    assert [r.url for r in FleetRegistry(LocalStore(run / "weights")).records()] in ([], [killed["url"]])
    assert 0.0 <= summary["heldout_pass1_after"] <= 1.0
