"""`whetstone eval` against a separate `whetstone serve` process, tasks validated in sandboxes
first: the deployment shape. Slow (a second Python with torch starts and loads the model)."""

from __future__ import annotations

import pytest

from tests.envs.eval.test_cli import check_eval
from tests.envs.harness.harness_support import save_tiny_model
from whetstone.utils.processes import serving

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("model"))


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    config = tmp_path_factory.mktemp("serve") / "serve.toml"
    config.write_text(f'model_path = "{model_dir}"\nthreads = 1\n[engine]\nmax_batch = 8\n')
    with serving([str(config)], config.with_name("serve.log")) as url:
        yield f"{url}/v1"


def test_eval_against_a_whetstone_serve_process(server, model_dir, tmp_path):
    check_eval(server, model_dir, tmp_path)  # validate_tasks=true: every task is checked in sandboxes first
