"""`whetstone run` on a real Ray cluster: three Ray nodes on this machine (separate raylet
processes, `ray.cluster_utils.Cluster`, shared by the tests of this module), CPU only. The head
node takes the trainer and the orchestrator; two nodes offer one cluster label each, `cluster:eu`
and `cluster:us`, and take one inference server each, following its cluster's own weight store
(`eu`'s on S3: a moto server). The trainer also runs as 2 ranks on two nodes. Faults: the whole
`us` cluster killed; the orchestrator and the trainer killed and restarted; a trainer rank lost."""

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.run.run_support import tiny_run
from whetstone.errors import ConfigError, WhetstoneError
from whetstone.fleet import FleetRegistry
from whetstone.rl.batch import batch_from_bytes
from whetstone.run.pipeline import Pipeline
from whetstone.run.preflight import check_run_config
from whetstone.run.ray_launch import _group_members, record_role, wait_for_predecessor
from whetstone.run.ray_ranks import rank_environments
from whetstone.store import LocalStore
from whetstone.sync import WeightStore
from whetstone.utils.metrics import read_metrics
from whetstone.utils.processes import GPU_MEMORY_ENV, RoleProcess

RAY = ['placement.backend="ray"', 'placement.ray.server_clusters=["eu", "us"]', "rl.steps=3"]


S3_BUCKET = "ray-weights"


def cluster_stores(tmp_path) -> str:
    return f'placement.ray.cluster_stores={{eu="{tmp_path / "eu-weights"}", us="{tmp_path / "us-weights"}"}}'


@pytest.fixture(scope="module")
def s3_endpoint():
    """A moto S3 server (bucket `ray-weights`), started before the Ray cluster so that its nodes,
    and the roles they start, inherit its placeholder credentials."""
    from whetstone.store.moto import local_s3

    with local_s3(S3_BUCKET) as endpoint:
        yield endpoint


def test_a_ray_run_without_ray_installed_is_refused_before_mid_training(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray fails, as where it is not installed
    with pytest.raises(ConfigError, match=r"needs Ray: pip install 'whetstone\[ray\]'"):
        check_run_config(tiny_run(tmp_path, *RAY).resolved())


@pytest.fixture(scope="module")
def ray_cluster(s3_endpoint):
    cluster_utils = pytest.importorskip("ray.cluster_utils")
    # logical CPUs: a server on each cluster node, and room beside it for a trainer rank
    cluster = cluster_utils.Cluster(initialize_head=True, head_node_args={"num_cpus": 2})
    try:
        cluster.add_node(num_cpus=2, resources={"cluster:eu": 1})
        cluster.add_node(num_cpus=2, resources={"cluster:us": 1})
        yield cluster
    finally:
        import ray

        ray.shutdown()
        cluster.shutdown()


def test_cluster_stores_are_the_trainers_mirrors_and_name_known_clusters(tmp_path):
    config = tiny_run(tmp_path, *RAY, cluster_stores(tmp_path)).resolved()
    assert config.rl.trainer.sync.mirrors == [str(tmp_path / "eu-weights"), str(tmp_path / "us-weights")]
    assert config.rl.orchestrator.total_batches == 3
    with pytest.raises(ConfigError, match=r"cluster_stores names clusters no server is in: \['asia'\]"):
        tiny_run(tmp_path, *RAY, 'placement.ray.cluster_stores={asia="x"}')


def test_ranks_get_torchruns_environment_from_where_their_actors_are():
    cpu = [
        {"ip": "10.0.0.1", "node": "a", "gpus": [], "port": 29500},
        {"ip": "10.0.0.2", "node": "b", "gpus": [], "port": 29501},
        {"ip": "10.0.0.1", "node": "a", "gpus": [], "port": 29502},
    ]
    envs = rank_environments(cpu)
    assert {(e["MASTER_ADDR"], e["MASTER_PORT"], e["WORLD_SIZE"]) for e in envs} == {("10.0.0.1", "29500", "3")}
    assert [(e["RANK"], e["LOCAL_RANK"], e["LOCAL_WORLD_SIZE"]) for e in envs] == [
        ("0", "0", "2"),
        ("1", "0", "1"),
        ("2", "1", "2"),
    ]
    assert all(e["CUDA_VISIBLE_DEVICES"] == "" for e in envs)  # no GPU, whatever Ray left set
    # GPUs: a node's ranks see all their GPUs, each taking the one Ray gave it (not its rank order)
    gpu = [{**place, "gpus": [g]} for place, g in zip(cpu, ["3", "0", "1"])]
    envs = rank_environments(gpu)
    assert [(e["CUDA_VISIBLE_DEVICES"], e["LOCAL_RANK"]) for e in envs] == [("1,3", "1"), ("0", "0"), ("1,3", "0")]
    assert not any(GPU_MEMORY_ENV in e for e in envs)
    # one rank on half a GPU (mid-training sharing its node's GPU): held to half its memory
    (alone,) = rank_environments([{**gpu[0], "gpus": ["3"]}], num_gpus=0.5)
    assert (alone["CUDA_VISIBLE_DEVICES"], alone["LOCAL_RANK"], alone[GPU_MEMORY_ENV]) == ("3", "0", "cuda:0=0.5")


def test_ranks_take_one_gpu_each_or_none(tmp_path):
    with pytest.raises(ConfigError, match=r"trainer.num_gpus = 0.5 with trainer_ranks = 2: each rank takes one"):
        tiny_run(tmp_path, *RAY, "placement.ray.trainer_ranks=2", "placement.ray.trainer.num_gpus=0.5")
    with pytest.raises(ConfigError, match=r"trainer_ranks > 1 needs trainer.num_cpus or trainer.num_gpus > 0"):
        tiny_run(tmp_path, *RAY, "placement.ray.trainer_ranks=2", "placement.ray.trainer.num_cpus=0")
    halves = ("placement.ray.midtrain_ranks=2", "placement.ray.midtrain={num_gpus=0.5}")
    with pytest.raises(ConfigError, match=r"midtrain.num_gpus = 0.5 with midtrain_ranks = 2: each rank takes one"):
        tiny_run(tmp_path, *RAY, *halves)
    with pytest.raises(ConfigError, match=r"midtrain_ranks > 1 needs midtrain: the resources of each rank"):
        tiny_run(tmp_path, *RAY, "placement.ray.midtrain_ranks=2")
    three = ("placement.ray.midtrain={num_gpus=1}", "placement.ray.midtrain_ranks=3")  # the tiny batch is 4 rows
    with pytest.raises(
        ConfigError, match=r"midtrain.run.batch_size \(4\) must be a multiple of .*midtrain_ranks \(3\)"
    ):
        tiny_run(tmp_path, *RAY, *three)


GPU_PROBE = """
import json, ray
from whetstone.run.ray_launch import gpu_environment
ray.init(num_cpus=4, num_gpus=2, log_to_driver=False, configure_logging=False, include_dashboard=False)
probe = ray.remote(lambda asked: gpu_environment(asked))
print(json.dumps([ray.get(probe.options(num_cpus=0.5, num_gpus=g).remote(g)) for g in (0, 1, 0.5)]))
ray.shutdown()
"""


def test_a_roles_process_sees_exactly_the_gpus_ray_gave_its_actor():
    # a local Ray with 2 GPUs it is told of (none here): the environment each role's process gets
    pytest.importorskip("ray")
    done = subprocess.run([sys.executable, "-c", GPU_PROBE], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    none, whole, half = json.loads(done.stdout.strip().splitlines()[-1])
    assert none == {"CUDA_VISIBLE_DEVICES": ""}  # not every GPU of the node: the CPU
    assert whole["CUDA_VISIBLE_DEVICES"] in ("0", "1") and GPU_MEMORY_ENV not in whole
    assert half[GPU_MEMORY_ENV] == "cuda:0=0.5" and half["CUDA_VISIBLE_DEVICES"] in ("0", "1")


def test_on_ray_the_gpus_are_asked_of_ray_not_named(tmp_path):
    with pytest.raises(ConfigError, match=r"server_devices\[1\] = 'cuda:1' with placement.backend = 'ray': Ray"):
        tiny_run(tmp_path, *RAY, 'placement.server_devices=["cuda", "cuda:1"]', "placement.ray.server.num_gpus=1")
    with pytest.raises(ConfigError, match=r"trainer_device = 'cuda' with placement.ray.trainer.num_gpus = 0"):
        tiny_run(tmp_path, *RAY, 'placement.trainer_device="cuda"')
    with pytest.raises(ConfigError, match=r"server.num_gpus = 2: a role's process computes on one GPU"):
        tiny_run(tmp_path, *RAY, "placement.ray.server.num_gpus=2")
    with pytest.raises(ConfigError, match=r"midtrain.run.device = 'cuda' with placement.ray.midtrain.num_gpus = 0"):
        tiny_run(tmp_path, *RAY, "placement.ray.midtrain={num_cpus=1}", 'midtrain.run.device="cuda"')
    # the trainer and the servers run on the cluster's GPUs, not this machine's: no complaint here
    config = tiny_run(tmp_path, *RAY, 'placement.trainer_device="cuda"', "placement.ray.trainer.num_gpus=1")
    check_run_config(config.resolved())
    on_ray = ("placement.ray.midtrain={num_cpus=1, num_gpus=1}", 'midtrain.run.device="cuda"')
    check_run_config(tiny_run(tmp_path, *RAY, *on_ray).resolved())  # mid-training too, with a GPU of the cluster


def test_a_vllm_server_on_ray_runs_vllms_python_announced_at_its_nodes_address(tmp_path):
    """What a server actor runs with `servers.engine = "vllm"`: vLLM's python (checked on the
    node, not where `whetstone run` runs) on a free port of every address, following its
    cluster's store, announced at the node's address in the run's registry, with the GPUs Ray
    gave it; a fraction of one GPU is vLLM's own memory share, not whetstone's cap."""
    import ray

    from whetstone.fleet import FleetConfig
    from whetstone.inference.config import ServeConfig
    from whetstone.integrations.vllm_serve import announcer_of, parse
    from whetstone.run.ray_launch import RoleActor, VllmServer

    on_nodes = ('servers.engine="vllm"', 'servers.vllm_python="/on/the/nodes/python"')
    check_run_config(tiny_run(tmp_path, *RAY, *on_nodes).resolved())
    with pytest.raises(ConfigError, match="/on/the/nodes/python' is not an executable file"):
        check_run_config(tiny_run(tmp_path, *on_nodes).resolved())  # where the run starts it itself
    for store in ("weights", "eu-weights"):
        (tmp_path / store).mkdir()
    serve = ServeConfig(
        model_path="/m",
        sync={"store": str(tmp_path / "eu-weights")},
        fleet=FleetConfig(cluster="eu", registry=str(tmp_path / "weights")),
    )
    placed = RoleActor._place_server(serve.model_dump(mode="json"))  # as the actor does on its node
    vllm = VllmServer(python=sys.executable, args=["--max-num-seqs", "4"], pause_limit_s=45)
    argv, env = vllm.command(placed, 0, tmp_path / "roles", {"CUDA_VISIBLE_DEVICES": ""})
    assert argv[:3] == [sys.executable, "-m", "whetstone.integrations.vllm_serve"]
    options = parse(argv[3:])
    assert (options.host, options.port, options.vllm_args) == ("0.0.0.0", placed.port, ["--max-num-seqs", "4"])
    assert options.pause_limit == 45
    assert '"store":"' + str(tmp_path / "eu-weights") + '"' in options.sync
    announcer = announcer_of(options)
    url = f"http://{ray.util.get_node_ip_address()}:{placed.port}/v1"
    assert (announcer.record.url, announcer.record.cluster) == (url, "eu")
    assert announcer.registry.objects.root == tmp_path / "weights"  # the run's registry, not the cluster's store
    assert (Path(env["PYTHONPATH"]) / "whetstone" / "integrations" / "vllm_serve.py").is_file()
    assert "--gpu-memory-utilization" not in argv and env["CUDA_VISIBLE_DEVICES"] == ""
    half, env = vllm.command(
        placed, 0.5, tmp_path / "roles", {"CUDA_VISIBLE_DEVICES": "1", GPU_MEMORY_ENV: "cuda:0=0.5"}
    )
    assert half[half.index("--gpu-memory-utilization") + 1] == "0.5"
    assert env["CUDA_VISIBLE_DEVICES"] == "1" and GPU_MEMORY_ENV not in env
    whole, env = vllm.command(placed, 1, tmp_path / "roles", {"CUDA_VISIBLE_DEVICES": "1"})
    assert "--gpu-memory-utilization" not in whole and env["CUDA_VISIBLE_DEVICES"] == "1"  # alone on its GPU
    with pytest.raises(ConfigError, match="is not an executable file on"):  # named with the node
        VllmServer(python=str(tmp_path / "python")).command(placed, 0, tmp_path / "roles", {})


def predecessor(tmp_path, script: str) -> tuple[RoleProcess, Path]:
    """A role process (`script` in python) as a role actor starts it, and its pid file."""
    role = RoleProcess("serve-0", [], tmp_path / "serve-0.log", command=[sys.executable, "-c", script], own_group=True)
    pid_path = tmp_path / "serve-0.pid"
    record_role(pid_path, role.start())
    return role, pid_path


def test_a_restarted_role_waits_for_its_predecessor_then_kills_it(tmp_path):
    # a role actor Ray restarts on the same node waits for the role process the dead one left
    old, pid_path = predecessor(tmp_path, "import time; time.sleep(60)")
    try:
        started = time.monotonic()
        wait_for_predecessor(pid_path, grace_s=1.0)
        assert old.wait(10) == -9 and time.monotonic() - started >= 1.0
    finally:
        old.kill()


def test_a_restarted_role_waits_for_the_processes_its_predecessor_started(tmp_path):
    # a vLLM server's engine core holds its GPU memory until it has exited too
    script = (
        "import subprocess, sys, time\n"
        "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
        "print('started', flush=True)\n"
        "time.sleep(60)\n"
    )
    old, pid_path = predecessor(tmp_path, script)
    try:
        while "started" not in old.log_tail():
            assert old.running
            time.sleep(0.05)
        assert old.stop() == -signal.SIGTERM  # the role's process has ended, its child has not
        (child,) = _group_members(old.process.pid)
        started = time.monotonic()
        wait_for_predecessor(pid_path, grace_s=1.0)
        assert time.monotonic() - started >= 1.0 and _group_members(old.process.pid) == []
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(old.process.pid, signal.SIGKILL)


def test_a_pid_another_process_took_is_not_waited_for(tmp_path):
    old, pid_path = predecessor(tmp_path, "pass")
    old.wait(10)
    host, pid, started = pid_path.read_text().split()
    pid_path.write_text(f"{host} {os.getpid()} {started}\n")  # this process, started at another time
    began = time.monotonic()
    wait_for_predecessor(pid_path, grace_s=30.0)
    assert time.monotonic() - began < 1.0


def test_a_vllm_server_announced_nowhere_is_refused_before_vllm_starts(capsys):
    from whetstone.integrations.vllm_serve import announcer_of, parse

    with pytest.raises(SystemExit) as refused:
        parse(["--model", "/m", "--fleet", '{"announce": true}'])
    assert refused.value.code == 2 and "--fleet needs --sync" in capsys.readouterr().err
    assert announcer_of(parse(["--model", "/m"])) is None


def kill_when(condition, kill, state: dict) -> threading.Thread:
    """A thread that runs `kill` once `condition` holds (polled), unless the test ends first."""

    def watch():
        while not condition():
            if state.get("stop"):
                return
            time.sleep(0.2)
        kill()

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


def role(pipeline: Pipeline, name: str):
    return next(r for r in pipeline.roles if r.name == name)


def assert_each_batch_trained_once(run, steps: int) -> None:
    trained = [s["step"] for s in read_metrics(run / "trainer" / "metrics.jsonl") if not s.get("replayed")]
    assert trained == list(range(steps))  # none lost, none trained twice (replays publish nothing)
    batches = LocalStore(run / "batches")
    keys = batches.list("batches/")
    assert len(keys) == steps
    for key in keys:
        meta = batch_from_bytes(batches.get(key), key).meta
        assert "dropped_failed" not in meta["groups"], meta  # no rollout lost to a dead server


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_tiny_run_goes_on_when_a_whole_cluster_dies(tmp_path, ray_cluster, s3_endpoint):
    """Each cluster follows its own weight store, `eu` a bucket on S3; cluster `us` (its one
    server) dies after batch 0."""
    import ray

    from whetstone.store.s3 import S3Store

    stores = f'placement.ray.cluster_stores={{eu="s3://{S3_BUCKET}/eu", us="{tmp_path / "us-weights"}"}}'
    config = tiny_run(
        tmp_path,
        *RAY,
        stores,
        f'rl.trainer.sync.endpoint_url="{s3_endpoint}"',
        f'placement.ray.address="{ray_cluster.address}"',
    )
    pipeline = Pipeline(config)
    run = tmp_path / "runs" / "tiny"
    batches = LocalStore(run / "batches")
    killed: dict = {}

    def kill_cluster_us():
        victim = role(pipeline, "serve-1")  # server i is in cluster i modulo ["eu", "us"]
        killed["url"] = victim.url
        ray.kill(victim.handle, no_restart=True)

    killer = kill_when(lambda: batches.exists("batches/0000000000.batch"), kill_cluster_us, killed)
    try:
        summary = pipeline.run()
    finally:
        killed["stop"] = True
        killer.join()

    assert "url" in killed, "the run ended before the cluster could be killed"
    with pytest.raises(httpx.HTTPError):  # the role died with its actor
        httpx.get(killed["url"].removesuffix("/v1") + "/health", timeout=5)
    assert_each_batch_trained_once(run, 3)
    records = read_metrics(run / "orchestrator" / "metrics.jsonl")
    # per cluster from the first batch on (the dead server leaves the pool at its next failed call,
    # or once its heartbeat is stale: maybe after the last batch)
    assert {"cluster_eu_servers", "cluster_us_servers"} <= set(records[0]) and records[0]["cluster_eu_servers"] == 1
    assert any("cluster_eu_staleness_mean" in record for record in records)
    placed = {r.name: r.url for r in pipeline.roles if r.url}
    assert set(placed) == {"serve-0", "serve-1"}
    main = WeightStore(LocalStore(run / "weights"))
    eu = WeightStore(S3Store(S3_BUCKET, "eu", endpoint_url=s3_endpoint))
    assert main.latest() == eu.latest() == 3  # the surviving cluster followed its own store to the end
    assert "s3://ray-weights/eu" in (run / "roles" / "serve-0.toml").read_text()  # eu's server followed S3
    # the server stopped at the end removed its record; the killed one's went stale (Ray SIGKILLs
    # an actor's children, so it could not say goodbye) and was dropped all the same
    assert [r.url for r in FleetRegistry(main.objects).records()] in ([], [killed["url"]])
    assert 0.0 <= summary["heldout_pass1_after"] <= 1.0


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_tiny_run_survives_its_orchestrator_and_its_trainer_killed(tmp_path, ray_cluster):
    """The orchestrator's actor is killed once batch 1 is put, the trainer's once step 1 is
    logged: Ray restarts each, the orchestrator continues at the next batch index, the trainer
    from its checkpoint, and every batch is put once and trained once."""
    import ray

    config = tiny_run(
        tmp_path,
        *RAY,
        "rl.steps=4",
        "rl.trainer.checkpoint_interval=2",
        f'placement.ray.address="{ray_cluster.address}"',
    )
    pipeline = Pipeline(config)
    run = tmp_path / "runs" / "tiny"
    batches = LocalStore(run / "batches")
    state: dict = {}

    def trainer_at(step: int) -> bool:
        return any(s["step"] >= step for s in read_metrics_if_any(run / "trainer" / "metrics.jsonl"))

    def kill(name: str):
        def go():
            state[name] = True
            ray.kill(role(pipeline, name).handle, no_restart=False)

        return go

    killers = [
        kill_when(lambda: batches.exists("batches/0000000001.batch"), kill("orchestrator"), state),
        kill_when(lambda: trainer_at(1), kill("trainer"), state),
    ]
    try:
        pipeline.run()
    finally:
        state["stop"] = True
        for killer in killers:
            killer.join()

    assert state.get("orchestrator") and state.get("trainer"), f"the run ended before both were killed: {state}"
    assert_each_batch_trained_once(run, 4)
    logs = (run / "logs" / "orchestrator.log").read_text()
    assert logs.count("put batch 0:") == 1  # the restarted orchestrator did not start over


VLLM_PYTHON = os.environ.get("WHETSTONE_VLLM_PYTHON", "")


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.timeout(1500)  # past the servers' own start bound, so that one fails first, with its log
@pytest.mark.skipif(
    not (VLLM_PYTHON and os.access(VLLM_PYTHON, os.X_OK)),
    reason="no vLLM environment: set $WHETSTONE_VLLM_PYTHON to its python (README, 'vLLM')",
)
def test_the_tiny_run_on_a_vllm_server_ray_placed(tmp_path, ray_cluster):
    """`servers.engine = "vllm"` on Ray: the server's actor starts vLLM on the node of cluster `eu`
    (at a free port, following eu's store), which announces itself in the run's registry; the
    orchestrator finds it there, every rollout of every batch comes from it, and its record goes
    with it at the end."""
    config = tiny_run(
        tmp_path,
        *RAY,
        'placement.ray.server_clusters=["eu"]',
        f'placement.ray.cluster_stores={{eu="{tmp_path / "eu-weights"}"}}',
        "servers.count=1",
        'servers.engine="vllm"',
        f'servers.vllm_python="{VLLM_PYTHON}"',
        'servers.vllm_args=["--max-model-len", "1024", "--enforce-eager"]',
        "servers.start_timeout_s=900",  # vLLM's start on 2 loaded cores
        "midtrain.model.head_dim=32",  # vLLM's CPU attention takes head sizes from 32 up
        f'placement.ray.address="{ray_cluster.address}"',
    )
    pipeline = Pipeline(config)
    summary = pipeline.run()
    run = tmp_path / "runs" / "tiny"

    assert_each_batch_trained_once(run, 3)
    (url,) = [r.url for r in pipeline.roles if r.url]
    assert not url.startswith("http://127.0.0.1")  # the node's address, as the registry has it
    log = (run / "logs" / "serve-0.log").read_text()
    assert f"announced {url} (cluster eu)" in log and "following the weight store from version 0" in log
    for key in LocalStore(run / "batches").list("batches/"):
        batch = batch_from_bytes(LocalStore(run / "batches").get(key), key)
        assert batch.routes is None  # vLLM's CPU build returns none: these rollouts are vLLM's
    records = read_metrics(run / "orchestrator" / "metrics.jsonl")
    assert all(record["cluster_eu_servers"] == 1 for record in records)
    assert WeightStore(LocalStore(tmp_path / "eu-weights")).latest() == 3  # it followed eu's store
    assert FleetRegistry(LocalStore(run / "weights")).records() == []  # its record went with it
    assert "heldout_pass1_after" in summary, summary  # the evaluations sampled from it too


def read_metrics_if_any(path):
    return read_metrics(path) if path.exists() else []


def trained_records(run) -> list[dict]:
    return [s for s in read_metrics(run / "trainer" / "metrics.jsonl") if not s.get("replayed")]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_tiny_run_trains_with_two_ranks_on_two_nodes(tmp_path, ray_cluster, capfd):
    """The trainer as 2 torch.distributed ranks (FSDP2 over gloo), one Ray actor each on its own
    node: every batch trained once, every version published once, by both ranks together.
    Mid-training runs on the cluster too, as 2 ranks on two nodes (`placement.ray.midtrain`),
    rank 0's output in its own log."""
    config = tiny_run(
        tmp_path,
        *RAY,
        "placement.ray.trainer_ranks=2",
        'placement.ray.trainer_strategy="STRICT_SPREAD"',
        f'placement.ray.address="{ray_cluster.address}"',
        "placement.ray.midtrain={num_cpus=1}",
        "placement.ray.midtrain_ranks=2",
        'placement.ray.midtrain_strategy="STRICT_SPREAD"',
    )
    pipeline = Pipeline(config)
    summary = pipeline.run()

    run = tmp_path / "runs" / "tiny"
    midtrain = summary["stages"]["midtrain"]
    assert midtrain["finished"] and midtrain["world_size"] == 2
    assert (run / "midtrain" / "model" / "config.json").exists()
    assert re.search(r"midtrain \S+: [\d,]+/[\d,]+ tok", (run / "logs" / "midtrain.log").read_text())  # its progress
    assert (run / "logs" / "midtrain-rank1.log").exists()
    err = capfd.readouterr().err.splitlines()  # its progress on the run's own bar, read from rank 0's metrics
    assert any(line.startswith("midtrain midtrain: 1,024/1,024 tok (100%)") for line in err)
    group = role(pipeline, "trainer")
    assert len(set(group.nodes)) == 2 and group.restarts == 0
    assert_each_batch_trained_once(run, 3)
    records = trained_records(run)
    assert [(r["step"], r["version"], r["world_size"]) for r in records] == [(0, 1, 2), (1, 2, 2), (2, 3, 2)]
    assert WeightStore(LocalStore(run / "weights")).latest() == 3
    assert (run / "logs" / "trainer-rank1.log").exists()

    # the two ranks trained the whole batch between them: one process on batch 0 counts the
    # same tokens and measures the same trainer-sampler mismatch (before any update)
    from whetstone.config import load_config
    from whetstone.trainer.config import TrainerConfig
    from whetstone.trainer.loop import run_trainer

    alone = tmp_path / "alone"
    run_trainer(
        load_config(
            TrainerConfig,
            run / "roles" / "trainer.toml",
            [f'output_dir="{alone}"', f'sync.store="{alone / "weights"}"', "max_steps=1"],
        )
    )
    (one,) = read_metrics(alone / "metrics.jsonl")
    assert one["world_size"] == 1 and one["tokens"] == records[0]["tokens"]
    assert one["mismatch_kl_k3"] == pytest.approx(records[0]["mismatch_kl_k3"], rel=1e-4, abs=1e-9)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_lost_trainer_rank_restarts_the_whole_group_which_replays(tmp_path, ray_cluster):
    """Rank 1's actor is killed once step 1 is logged (its process dies with it): rank 0 cannot
    go on alone, so both ranks are started again; with no checkpoint yet they replay every
    published step without publishing, and train on from there."""
    import ray

    config = tiny_run(
        tmp_path,
        *RAY,
        "rl.steps=4",
        "rl.trainer.checkpoint_interval=100",  # none before the end: the restart replays
        "placement.ray.trainer_ranks=2",
        f'placement.ray.address="{ray_cluster.address}"',
    )
    pipeline = Pipeline(config)
    run = tmp_path / "runs" / "tiny"
    state: dict = {}

    def kill_rank_1():
        group = role(pipeline, "trainer")
        state["pid"], state["node"] = group.pids[1], group.nodes[1]
        ray.kill(group.handles[1], no_restart=True)

    trained = lambda: any(s["step"] >= 1 for s in read_metrics_if_any(run / "trainer" / "metrics.jsonl"))  # noqa: E731
    killer = kill_when(trained, kill_rank_1, state)
    try:
        pipeline.run()
    finally:
        state["stop"] = True
        killer.join()

    assert "pid" in state, "the run ended before the rank could be killed"
    group = role(pipeline, "trainer")
    assert group.restarts == 1 and group.pids[1] != state["pid"]
    assert_each_batch_trained_once(run, 4)
    records = read_metrics(run / "trainer" / "metrics.jsonl")
    assert [r["version"] for r in records if not r["replayed"]] == [1, 2, 3, 4]  # each published once
    replayed = [r for r in records if r["replayed"]]
    assert replayed and [r["step"] for r in replayed] == list(range(len(replayed)))
    assert replayed[-1]["replay_matches_store"]  # the replay rebuilt the weights the servers hold


@pytest.mark.slow
def test_ranks_no_node_can_hold_are_refused_with_what_was_asked(tmp_path, ray_cluster):
    import ray

    from whetstone.run.ray_launch import RayConfig, RayLauncher
    from whetstone.run.ray_ranks import RankGroup
    from whetstone.trainer.config import TrainerConfig

    asks = RayConfig(trainer_ranks=2, trainer={"num_cpus": 64}, place_timeout_s=2)
    ray.init(address=ray_cluster.address, log_to_driver=False, configure_logging=False)
    try:
        with pytest.raises(WhetstoneError, match=r"trainer was not placed .* offer 2 x \{'CPU': 64.0\} \(PACK\)\?"):
            RankGroup("trainer", "trainer", TrainerConfig(), tmp_path, asks).start()
        # mid-training asking for a GPU of a cluster without any: an error, not a wait for ever
        midtrain = RayLauncher(RayConfig(midtrain={"num_gpus": 1}, place_timeout_s=2), tmp_path)
        with pytest.raises(WhetstoneError, match=r"midtrain was not placed .* offer 1 x \{'CPU': 1.0, 'GPU': 1.0\}"):
            midtrain.midtrain(tiny_run(tmp_path, *RAY).resolved(), follow=RankGroup.wait)
        assert ray.util.placement_group_table() and all(
            group["state"] == "REMOVED" for group in ray.util.placement_group_table().values()
        )
    finally:
        ray.shutdown()
