"""whetstone's side of vLLM without vLLM: reading its answers (version spans, routed experts in
its `.npy` form), the run config that selects it, and the command line that starts it."""

from __future__ import annotations

import asyncio
import base64
import io
import math
import sys

import httpx
import numpy as np
import pytest
import torch

from whetstone.config import load_config
from whetstone.envs.harness import EndpointConfig, Sampling
from whetstone.envs.harness.policy import PolicyError
from whetstone.envs.trajectory import ModelCall, Segment, Trajectory
from whetstone.errors import ConfigError
from whetstone.inference.config import ServeConfig
from whetstone.inference.protocol import decode_routes
from whetstone.integrations.vllm import (
    GENERATE_PATH,
    VllmPolicy,
    gpu_placement,
    serve_command,
    token_versions,
    vllm_launch,
    vllm_python,
    vllm_routes,
    whetstone_path,
)
from whetstone.integrations.vllm_serve import PAUSE_LIMIT_S, parse
from whetstone.rl.advantages.groups import _drop_reason
from whetstone.run.config import PipelineConfig


def test_version_spans_become_one_version_per_token():
    spans = [{"version": "3", "start": 0, "end": 2}, {"version": "4", "start": 2, "end": 5}]
    assert token_versions(spans, 5, default=0) == [3, 3, 4, 4, 4]
    assert token_versions([{"version": "default", "start": 0, "end": 2}], 2, default=7) == [7, 7]
    assert token_versions(None, 3, default=1) == [1, 1, 1]


@pytest.mark.parametrize(
    "spans",
    [
        [{"version": "1", "start": 0, "end": 2}],
        [{"version": "1", "start": 1, "end": 3}],
        [{"version": "1", "start": 0}],
    ],
)
def test_version_spans_that_do_not_cover_the_tokens_are_refused(spans):
    with pytest.raises(PolicyError, match="spans"):
        token_versions(spans, 3, default=0)


def test_routed_experts_in_vllms_npy_form_become_whetstones():
    routes = np.arange(5 * 2 * 2, dtype=np.uint8).reshape(5, 2, 2) % 8
    with io.BytesIO() as buffer:  # as vLLM's numpy2base64 writes them
        np.save(buffer, routes, allow_pickle=False)
        encoded = base64.b64encode(buffer.getvalue()).decode()
    assert torch.equal(decode_routes(vllm_routes(encoded)), torch.from_numpy(routes.astype(np.int64)))
    with pytest.raises(PolicyError, match="do not decode"):
        vllm_routes(base64.b64encode(b"not numpy").decode())


def test_servers_engine_vllm_makes_the_orchestrator_and_the_evaluations_speak_vllm():
    config = PipelineConfig.model_validate({"servers": {"engine": "vllm"}}).resolved(["http://127.0.0.1:9/v1"])
    assert config.rl.orchestrator.endpoint.engine == config.eval.endpoint.engine == "vllm"
    assert PipelineConfig().resolved().rl.orchestrator.endpoint.engine == "whetstone"


def test_vllms_python_must_be_named_and_exist(monkeypatch, tmp_path):
    monkeypatch.delenv("WHETSTONE_VLLM_PYTHON", raising=False)
    with pytest.raises(ConfigError, match="servers.vllm_python or \\$WHETSTONE_VLLM_PYTHON"):
        vllm_python("")
    with pytest.raises(ConfigError, match="is not an executable file"):
        vllm_python(str(tmp_path / "missing" / "python"))
    monkeypatch.setenv("WHETSTONE_VLLM_PYTHON", "/bin/sh")
    assert vllm_python("") == "/bin/sh"


def test_the_server_command_runs_whetstones_launcher_with_only_whetstone_on_the_path(tmp_path):
    command = serve_command("/venv/bin/python", "/m", 8001, '{"store": "w"}', 3, ["--max-num-seqs", "4"])
    assert command[:3] == ["/venv/bin/python", "-m", "whetstone.integrations.vllm_serve"]
    assert command[command.index("--sync") + 1] == '{"store": "w"}' and command[-3:] == ["--", "--max-num-seqs", "4"]
    path = whetstone_path(tmp_path / "p")
    assert sorted(p.name for p in (tmp_path / "p").iterdir()) == ["whetstone"]
    assert (tmp_path / "p" / "whetstone" / "integrations" / "vllm_serve.py").is_file() and path == str(tmp_path / "p")


def test_the_pause_limit_is_a_servers_setting_that_reaches_the_launchers_command_line(tmp_path):
    """`servers.vllm_pause_limit_s` from a run's TOML to `vllm_serve --pause-limit`; 120 s unless set."""
    assert PAUSE_LIMIT_S == 120
    (tmp_path / "run.toml").write_text('[servers]\nengine = "vllm"\nvllm_pause_limit_s = 30.5\n')
    servers = load_config(PipelineConfig, tmp_path / "run.toml").servers
    assert servers.vllm_pause_limit_s == 30.5 and PipelineConfig().servers.vllm_pause_limit_s == PAUSE_LIMIT_S
    for wrong in ("0", "-1"):
        with pytest.raises(ConfigError, match="servers.vllm_pause_limit_s: Input should be greater than 0"):
            load_config(PipelineConfig, overrides=[f"servers.vllm_pause_limit_s={wrong}"])
    serve = ServeConfig(model_path="/m")
    launch = vllm_launch(
        sys.executable, serve, torch.device("cpu"), None, [], tmp_path / "p", servers.vllm_pause_limit_s
    )
    assert parse(launch[0][3:]).pause_limit == 30.5
    assert parse(serve_command(sys.executable, "/m", 8001, None)[3:]).pause_limit == PAUSE_LIMIT_S


def test_whetstone_run_starts_vllm_servers_that_follow_the_runs_weight_store(monkeypatch, tmp_path):
    from whetstone.run.pipeline import Pipeline

    monkeypatch.setenv("WHETSTONE_VLLM_PYTHON", "/bin/sh")
    config = PipelineConfig.model_validate(
        {
            "output_dir": str(tmp_path),
            "servers": {"engine": "vllm", "vllm_args": ["--max-num-seqs", "4"], "vllm_pause_limit_s": 30},
            "placement": {"server_devices": ["cpu"]},  # on any machine
        }
    )
    launch = Pipeline(config).vllm_server(8123, 0)
    argv = launch["argv"]
    assert argv[:3] == ["/bin/sh", "-m", "whetstone.integrations.vllm_serve"]
    assert argv[argv.index("--model") + 1] == str(tmp_path / "default" / "midtrain" / "model")
    assert '"store":"' + str(tmp_path / "default" / "weights") + '"' in argv[argv.index("--sync") + 1]
    assert argv[-2:] == ["--max-num-seqs", "4"] and launch["env"]["PYTHONPATH"].startswith(str(tmp_path))
    assert "--gpu-memory-utilization" not in argv and "CUDA_VISIBLE_DEVICES" not in launch["env"]
    assert argv[argv.index("--pause-limit") + 1] == "30.0"


def test_a_vllm_server_on_a_shared_gpu_takes_its_share_and_its_gpu(monkeypatch):
    # vLLM would otherwise take the first visible GPU and 90% of its memory, beside the trainer
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert gpu_placement(torch.device("cuda", 1), 0.25, ["--max-num-seqs", "4"]) == (
        ["--gpu-memory-utilization", "0.25"],
        {"CUDA_VISIBLE_DEVICES": "1"},
    )
    assert gpu_placement(torch.device("cuda", 0), None, []) == ([], {"CUDA_VISIBLE_DEVICES": "0"})  # alone on it
    assert gpu_placement(torch.device("cuda", 0), 0.5, ["--gpu-memory-utilization=0.3"])[0] == []  # the user's
    assert gpu_placement(torch.device("cpu"), None, []) == ([], {})
    # where the run itself sees some GPUs only, cuda:N is the N-th of them
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    assert gpu_placement(torch.device("cuda", 1), None, [])[1] == {"CUDA_VISIBLE_DEVICES": "3"}


def test_a_run_on_vllm_without_vllms_python_stops_before_mid_training(monkeypatch, tmp_path):
    from whetstone.run.preflight import check_run_config

    monkeypatch.delenv("WHETSTONE_VLLM_PYTHON", raising=False)
    config = PipelineConfig.model_validate({"output_dir": str(tmp_path), "servers": {"engine": "vllm"}}).resolved()
    with pytest.raises(ConfigError, match="the run cannot start:\n.*servers.vllm_python"):
        check_run_config(config)


def generate_answer(finish_reason: str, ids: list[int]) -> dict:
    """vLLM's `/inference/v1/generate` answer (output_mode "tokens") for `ids` sampled by version 3."""
    content = [{"token_id": i, "logprob": -0.5, "rank": 1, "top_logprobs": []} for i in ids]
    choice = {"index": 0, "finish_reason": finish_reason, "stop_reason": None, "token_ids": ids}
    choice |= {"logprobs": {"content": content}, "routed_experts": None}
    choice["weight_versions"] = [{"version": "3", "start": 0, "end": len(ids)}] if ids else []
    return {"request_id": "r", "model": "m", "output_mode": "tokens", "choices": [choice]}


def generate(answer: dict):
    """What `VllmPolicy` makes of `answer`, and the requests it sent to get it."""
    asked = []

    def vllm(request: httpx.Request) -> httpx.Response:
        asked.append(request.url.path)
        return httpx.Response(200, json=answer)

    async def complete():
        async with httpx.AsyncClient(transport=httpx.MockTransport(vllm)) as client:
            config = EndpointConfig(base_url="http://vllm:8000/v1", engine="vllm", return_routed_experts=False)
            return await VllmPolicy(config, "m", None, client).complete([1, 2, 3], Sampling(max_tokens=4))

    return asyncio.run(complete()), asked


def test_a_generation_vllm_aborted_is_a_failed_call_not_a_reply():
    """vLLM answers a request it stopped (its server stopping, `/abort_requests`, a `/pause` that
    aborts) with 200 and what it had sampled: taken as the reply, the rollout would go on from a
    cut-off turn, or an empty one, as if the model had ended it."""
    completion, asked = generate(generate_answer("length", [7, 8]))
    assert (completion.ids, completion.versions, completion.finish_reason) == ([7, 8], [3, 3], "length")
    for ids in ([7, 8], []):
        with pytest.raises(PolicyError, match=f"vLLM aborted the generation after {len(ids)} tokens"):
            generate(generate_answer("abort", ids))
    assert asked == [GENERATE_PATH]


@pytest.mark.parametrize("floor", [-9999.0, -12345.0])
def test_vllms_logprob_floor_is_a_token_of_probability_0_not_a_number_to_train_on(floor):
    """vLLM's generate route sends -inf, NaN and a logprob it does not hold as -9999.0: taken as
    a number, the token's importance ratio against the trainer would be exp(~9999). Read as -inf,
    the orchestrator drops the rollout (`nonfinite_logprobs`) as it does one of whetstone's engine."""
    answer = generate_answer("stop", [7, 8])
    answer["choices"][0]["logprobs"]["content"][1]["logprob"] = floor
    completion, _ = generate(answer)
    assert completion.logprobs == [-0.5, -math.inf]
    call = ModelCall(
        prompt_ids=[1, 2, 3], completion_ids=[7, 8], logprobs=completion.logprobs, versions=[3, 3], loss_mask=[1, 1]
    )
    rollout = Trajectory(task_id="t", segments=[Segment(calls=[call])])
    assert _drop_reason(rollout) == "nonfinite_logprobs"
    answer["choices"][0]["logprobs"]["content"][1]["logprob"] = -9998.5  # improbable, yet a logprob
    assert generate(answer)[0].logprobs == [-0.5, -9998.5]


def test_a_logprob_entry_vllm_did_not_fill_is_a_failed_call_not_a_traceback():
    answer = generate_answer("stop", [7, 8])
    del answer["choices"][0]["logprobs"]["content"][0]["logprob"]
    with pytest.raises(PolicyError, match="not an answer of vLLM's /inference/v1/generate"):
        generate(answer)
