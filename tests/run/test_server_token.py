"""A run whose servers take a token (`servers.serve.auth_token`): the run's clients (the
orchestrator, the evaluations) get it through `SERVER_TOKEN_ENV` in their own environment only,
never in a client's config file; vLLM servers, which whetstone starts without a key, are refused
one. The whole tiny run with a token: the first test of tests/run/test_pipeline.py."""

import asyncio
import json
import os
import shutil
import subprocess
import sys
import time

import pytest

from tests.envs.harness.harness_support import save_tiny_model
from tests.orchestrator.orchestrator_support import Trainer
from tests.run.run_support import tiny_run
from whetstone.config import write_toml
from whetstone.envs.harness.policy import HttpPolicy, PolicyError
from whetstone.errors import ConfigError
from whetstone.run.config import SERVER_TOKEN_ENV
from whetstone.run.pipeline import Pipeline

TOKEN = "run-token-4f1c"
WITH_TOKEN = f'servers.serve.auth_token="{TOKEN}"'


def test_the_clients_name_the_token_variable_and_vllm_servers_are_refused_one(tmp_path):
    config = tiny_run(tmp_path, WITH_TOKEN).resolved()
    assert config.rl.orchestrator.endpoint.api_key_env == config.eval.endpoint.api_key_env == SERVER_TOKEN_ENV
    assert config.resolved(["http://127.0.0.1:9/v1"]).resolved() == config.resolved(["http://127.0.0.1:9/v1"])
    assert tiny_run(tmp_path).resolved().eval.endpoint.api_key_env is None  # no token, no variable
    with pytest.raises(ConfigError, match=r"servers: serve.auth_token is set with engine = 'vllm', but whetstone"):
        tiny_run(tmp_path, WITH_TOKEN, 'servers.engine="vllm"')


async def served_model(endpoint) -> str:
    policy = await HttpPolicy.connect(endpoint)
    await policy.close()
    return policy.model


@pytest.mark.timeout(120)
def test_the_servers_answer_the_clients_the_run_gave_the_token(tmp_path, monkeypatch):
    monkeypatch.delenv(SERVER_TOKEN_ENV, raising=False)
    pipeline = Pipeline(tiny_run(tmp_path, WITH_TOKEN, "servers.count=1"))
    shutil.copytree(save_tiny_model(tmp_path / "tiny"), pipeline.model_dir)  # as mid-training leaves it
    run = pipeline.run_dir
    with pipeline.roles_stopped():
        pipeline.start_servers()  # a real `whetstone serve`, its token from roles/serve-0.toml
        endpoint = pipeline.config.eval.endpoint.model_copy(update={"base_url": pipeline.urls[0]})
        with pytest.raises(PolicyError, match=f"environment variable {SERVER_TOKEN_ENV} is not set"):
            asyncio.run(served_model(endpoint))
        with pytest.raises(PolicyError, match="HTTP 401: missing or wrong bearer token"):  # a client without it
            asyncio.run(served_model(endpoint.model_copy(update={"api_key_env": None})))
        with pipeline.client_key():  # as the evaluations run, in this process
            assert asyncio.run(served_model(endpoint)) == "model"
        assert SERVER_TOKEN_ENV not in os.environ  # only while they run
        orchestrator = pipeline.start_orchestrator()
        assert orchestrator.env[SERVER_TOKEN_ENV] == TOKEN
        Trainer(str(pipeline.model_dir), run / "weights").publish()  # version 0, which its first batch waits for
        log = run / "logs" / "serve-0.log"
        while "POST /v1/completions 200" not in log.read_text():  # the orchestrator's rollouts are answered
            orchestrator.check()
            assert orchestrator.running, orchestrator.log_tail()
            time.sleep(0.2)
    for role in ("serve-0", "orchestrator"):  # only the server's own config holds the token
        assert (TOKEN in (run / "roles" / f"{role}.toml").read_text()) == (role == "serve-0")


RAY_ORCHESTRATOR = """
import json, sys
import ray
from whetstone.config import load_config
from whetstone.run.config import SERVER_TOKEN_ENV, PipelineConfig
from whetstone.run.pipeline import Pipeline

ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
pipeline = Pipeline(load_config(PipelineConfig, sys.argv[1]))
try:
    role = pipeline.start_orchestrator()
    env = ray.get(role.handle.__ray_call__.remote(lambda actor: actor.role.env))  # what its process got
    print(json.dumps({"token": env.get(SERVER_TOKEN_ENV)}))
finally:
    pipeline.stop_roles()
    ray.shutdown()
"""


@pytest.mark.timeout(300)
def test_on_ray_the_orchestrators_process_gets_the_token_its_config_file_does_not(tmp_path):
    pytest.importorskip("ray")
    config = tmp_path / "run.toml"
    write_toml(config, tiny_run(tmp_path, WITH_TOKEN, 'placement.backend="ray"'))
    env = {key: value for key, value in os.environ.items() if key != SERVER_TOKEN_ENV}
    done = subprocess.run(
        [sys.executable, "-c", RAY_ORCHESTRATOR, str(config)], capture_output=True, text=True, timeout=240, env=env
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == {"token": TOKEN}
    written = (tmp_path / "runs" / "tiny" / "roles" / "orchestrator.toml").read_text()
    assert f'api_key_env = "{SERVER_TOKEN_ENV}"' in written and TOKEN not in written
