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


def test_a_group_smaller_than_the_smallest_kept_one_is_refused():
    with pytest.raises(ConfigError, match=r"advantages.min_group_size \(4\) exceeds group_size \(2\)"):
        load_config(OrchestratorConfig, overrides=["group_size=2", "advantages.min_group_size=4"])
    assert OrchestratorConfig(group_size=4, advantages={"min_group_size": 4}).group_size == 4


def test_a_registry_record_forgotten_before_its_server_is_refused():
    with pytest.raises(
        ConfigError, match=r"forget_servers_after_s \(10\) must be longer than server_heartbeat_timeout_s"
    ):
        load_config(OrchestratorConfig, overrides=["forget_servers_after_s=10"])
    assert OrchestratorConfig(forget_servers_after_s=11).forget_servers_after_s == 11


def test_a_mistyped_server_address_is_refused_when_the_config_loads():
    with pytest.raises(ConfigError, match=r"servers.0: 'http://gpu-3:port/v1' is not a server address: Invalid port"):
        load_config(OrchestratorConfig, overrides=['servers=["http://gpu-3:port/v1"]'])
    with pytest.raises(ConfigError, match=r"'gpu-3:8000/v1' is not a server address: give http\(s\)://host:port/v1"):
        load_config(OrchestratorConfig, overrides=['servers=["gpu-3:8000/v1"]'])
    with pytest.raises(ConfigError, match=r"'http://127.0.0.1:80000/v1' is not a server address: port 80000"):
        load_config(OrchestratorConfig, overrides=['servers=["http://127.0.0.1:80000/v1"]'])
    with pytest.raises(ConfigError, match=r"'\$\{head\}' is a placeholder"):  # hosts are lower-cased
        load_config(OrchestratorConfig, overrides=['servers=["http://${HEAD}:8000/v1"]'])
    assert load_config(OrchestratorConfig, overrides=['servers=["http://[::1]:8000/v1"]']).servers == [
        "http://[::1]:8000/v1"
    ]
    with pytest.raises(ConfigError, match=r"endpoint.base_url: 'http://:8000/v1' is not a server address"):
        load_config(OrchestratorConfig, overrides=['endpoint.base_url="http://:8000/v1"'])
