"""Several inference clusters, each following its own weight store: one publisher fans every
version out to the clusters' mirrors, the servers of a cluster follow its mirror and announce
themselves in the main store's registry, and the orchestrator reports per cluster."""

import asyncio
import time

import httpx

from tests.orchestrator.orchestrator_support import ThreadServer, Trainer, coin_tasks, model_folder, orchestrator_config
from whetstone.fleet.registry import FleetRegistry
from whetstone.orchestrator import Orchestrator
from whetstone.store import LocalStore
from whetstone.sync import WeightStore
from whetstone.utils.metrics import read_metrics


def weight_version(server: ThreadServer) -> int:
    return httpx.get(server.url.removesuffix("/v1") + "/health", timeout=5).json()["weight_version"]


def test_each_cluster_follows_its_own_store_and_reports_the_staleness_of_what_it_made(tmp_path):
    model_dir = model_folder(tmp_path)
    main, eu_store, us_store = tmp_path / "weights", tmp_path / "eu-weights", tmp_path / "us-weights"
    trainer = Trainer(model_dir, main, mirrors=[eu_store, us_store])
    trainer.publish()  # version 0, in all three stores
    eu = ThreadServer(model_dir, eu_store, cluster="eu", registry=main).start()
    us = ThreadServer(model_dir, us_store, cluster="us", registry=main).start()
    try:
        # Both announced before the orchestrator looks: one found late would take no rollout.
        registry, deadline = FleetRegistry(LocalStore(main)), time.monotonic() + 60
        while {r.cluster for r in registry.records()} != {"eu", "us"}:
            assert time.monotonic() < deadline, "a server did not announce itself"
            time.sleep(0.05)
        metrics = tmp_path / "orchestrator.jsonl"
        config = orchestrator_config(
            tmp_path, model_dir, [], discover_servers=True, metrics_path=str(metrics), max_batches=1
        )
        orchestrator = Orchestrator(config, coin_tasks(2))
        assert asyncio.run(orchestrator.run()) == [0]
        assert {s.cluster for s in orchestrator.pool.servers} == {"eu", "us"}
        (record,) = read_metrics(metrics)
        # Least-loaded dispatch mostly puts a group's two rollouts on both clusters, but a rollout
        # that ends between its group's two leases leaves both on one: each cluster that made
        # samples reports their staleness, and every cluster its servers.
        made = [cluster for cluster in ("eu", "us") if f"cluster_{cluster}_samples" in record]
        assert made and sum(record[f"cluster_{cluster}_samples"] for cluster in made) == record["samples"]
        for cluster in made:
            assert record[f"cluster_{cluster}_samples"] >= 1 and record[f"cluster_{cluster}_staleness_mean"] == 0
            assert record[f"cluster_{cluster}_staleness_max"] == 0
        assert record["cluster_eu_servers"] == record["cluster_us_servers"] == 1
        assert sum(orchestrator.pool.rollouts.values()) >= 2

        trainer.publish()  # version 1 reaches each server through its own cluster's store
        deadline = time.monotonic() + 60
        while {weight_version(eu), weight_version(us)} != {1}:
            assert time.monotonic() < deadline, "a server did not reach version 1 through its mirror"
            time.sleep(0.1)
        main_store = WeightStore(LocalStore(main))
        for mirror in (eu_store, us_store):
            assert WeightStore(LocalStore(mirror)).head() == main_store.head()
            assert not LocalStore(mirror).list("fleet/")  # the registry is the main store's only
    finally:
        eu.stop(), us.stop()
