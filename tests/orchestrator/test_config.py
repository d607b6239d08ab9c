import pytest
from pydantic import ValidationError
from typer.testing import CliRunner

from whetstone.config import load_config
from whetstone.errors import ConfigError
from whetstone.orchestrator import OrchestratorConfig
from whetstone.orchestrator.cli import app


def test_defaults_serve_the_embedded_run():
    config = OrchestratorConfig()
    assert len(config.servers) == 2 and config.group_size == 8
    assert config.staleness.max_off_policy_steps == 2 and config.advantages.estimator == "grpo"
    assert config.tasks.source == "synth" and config.tasks.synth.split == "train"
    assert not config.synchronous  # asynchronous RL unless asked


def test_a_server_list_must_name_servers_once():
    with pytest.raises(ValidationError, match="servers is empty"):
        OrchestratorConfig(servers=[])
    with pytest.raises(ValidationError, match="twice"):
        OrchestratorConfig(servers=["http://a:1/v1", "http://a:1/v1"])


def test_toml_and_overrides_are_checked_and_named(tmp_path):
    path = tmp_path / "orchestrator.toml"
    path.write_text('servers = ["http://10.0.0.7:8000/v1"]\ngroup_size = 4\n[staleness]\nmax_off_policy_steps = 1\n')
    config = load_config(OrchestratorConfig, path, ["advantages.estimator=rloo"])
    assert config.servers == ["http://10.0.0.7:8000/v1"] and config.group_size == 4
    assert config.staleness.max_off_policy_steps == 1 and config.advantages.estimator == "rloo"
    with pytest.raises(ConfigError, match="group_size"):
        load_config(OrchestratorConfig, path, ["group_size=1"])


def test_cli_reports_a_bad_config_by_name():
    result = CliRunner().invoke(app, ["orchestrator", "--set", "groups_per_batch=0"])
    assert isinstance(result.exception, ConfigError) and "groups_per_batch" in str(result.exception)


@pytest.mark.parametrize("sampling", [{"temperature": 0.0}, {"temperature": 1e-6}, {"top_p": 0.9}, {"top_k": 20}])
def test_rl_refuses_sampling_the_trainer_cannot_reproduce(sampling):
    with pytest.raises(ValidationError, match="RL trains on the sampled distribution"):
        OrchestratorConfig(harness={"sampling": sampling})
