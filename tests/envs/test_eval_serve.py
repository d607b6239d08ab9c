"""`whetstone eval` against a separate `whetstone serve` process, tasks validated in sandboxes
first: the deployment shape. Slow (a second Python with torch starts and loads the model)."""

from __future__ import annotations

import subprocess
import sys
import time

import httpx
import pytest

from tests.envs.test_eval_cli import check_eval
from tests.envs.test_harness_support import free_port, save_tiny_model

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("model"))


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    port = free_port()
    config = tmp_path_factory.mktemp("serve") / "serve.toml"
    config.write_text(f'model_path = "{model_dir}"\nport = {port}\nthreads = 1\n[engine]\nmax_batch = 8\n')
    process = subprocess.Popen([sys.executable, "-m", "whetstone.inference.cli", "serve", str(config)],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip
    try:
        deadline = time.monotonic() + 120  # torch import and model load on a busy machine
        while True:
            assert process.poll() is None, f"whetstone serve exited:\n{process.stdout.read()}"
            assert time.monotonic() < deadline, "whetstone serve did not come up"
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        process.terminate()
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def test_eval_against_a_whetstone_serve_process(server, model_dir, tmp_path):
    check_eval(server, model_dir, tmp_path)  # validate_tasks=true: every task is checked in sandboxes first
