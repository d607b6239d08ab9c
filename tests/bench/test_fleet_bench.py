"""`whetstone bench fleet` at its smallest sizes: real servers, real rollouts, one cluster killed."""

import json

import pytest
from typer.testing import CliRunner

from whetstone.bench.cli import app


@pytest.mark.timeout(900)
def test_the_fleet_bench_reports_scaling_join_and_cluster_loss(tmp_path):
    args = ["fleet", "--json", "--servers", "1", "--servers", "2", "--rollouts-per-server", "2", "--behind", "3"]
    args += ["--loss-rollouts", "6", "--output-dir", str(tmp_path)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    scaling = report["scaling"]
    assert scaling["rollouts_per_s_1"] > 0 and scaling["rollouts_per_s_2"] > 0 and scaling["scaling_efficiency_1"] == 1
    assert scaling["failed_1"] == scaling["failed_2"] == 0
    join = report["join"]
    assert join["behind_versions"] == 3 and join["first_rollout_versions"] == [3]  # on the current weights
    assert 0 < join["first_answer_s"] <= join["start_to_current_weights_s"] <= join["start_to_first_rollout_s"]
    loss = report["cluster_loss"]
    assert loss["rollouts"] == 6 and loss["rollouts_lost"] == 0
    assert sum(loss["finished_by_cluster"].values()) == 6
