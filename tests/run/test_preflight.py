"""Before its first stage `whetstone run` checks every path, task source, core and folder the
stages need, and `--dry-run` prints the config as the stages would run it."""

import json
import tomllib

import pytest
from typer.testing import CliRunner

from tests.run.run_support import tiny_run, tiny_settings
from whetstone.cli import app
from whetstone.config import load_config
from whetstone.envs.tasks.registry import TasksConfig, load_tasks
from whetstone.errors import ConfigError, WhetstoneError
from whetstone.run.config import PipelineConfig
from whetstone.run.pipeline import run_pipeline
from whetstone.run.preflight import check_run_config

MISSING = "/nonexistent/tasks.jsonl"


def test_a_missing_rl_task_source_stops_the_run_before_mid_training(tmp_path):
    config = tiny_run(tmp_path, f'rl.orchestrator.tasks.source="{MISSING}"')
    with pytest.raises(ConfigError) as refused:
        run_pipeline(config)
    with pytest.raises(WhetstoneError) as later:  # what the orchestrator would have said, minutes later
        load_tasks(TasksConfig(source=MISSING))
    assert f"rl.orchestrator.tasks.source: {later.value}" in str(refused.value)
    assert not (tmp_path / "runs" / "tiny").exists()  # nothing ran, nothing was written


def test_every_problem_is_named_by_its_key_at_once(tmp_path):
    bad_tasks = tmp_path / "bad.jsonl"
    bad_tasks.write_text('{"id": "a"}\n')
    config = tiny_run(
        tmp_path,
        f'eval.tasks.source="{bad_tasks}"',
        f'rl.trainer.demos_path="{tmp_path}/no-demos.jsonl"',
        f'midtrain.data.directories=[{{path="{tmp_path}/no-code"}}]',
        'rl.orchestrator.tasks.source="mutate"',
        f'rl.orchestrator.tasks.mutate.project="{tmp_path}/no-project"',
        f'midtrain.run.init_from="{tmp_path}/no-base"',
    )
    with pytest.raises(ConfigError) as refused:
        run_pipeline(config)
    message = str(refused.value)
    assert f"midtrain.data.directories[0].path: folder '{tmp_path}/no-code' does not exist" in message
    assert f"midtrain.run.init_from: file '{tmp_path}/no-base/config.json' does not exist" in message
    assert f"rl.trainer.demos_path: file '{tmp_path}/no-demos.jsonl' does not exist" in message
    assert f"rl.orchestrator.tasks.mutate.project: folder '{tmp_path}/no-project' does not exist" in message
    assert f"eval.tasks.source: {bad_tasks}:1: field" in message  # the bad record, by file and line
    assert not (tmp_path / "runs" / "tiny").exists()


def test_a_run_folder_that_cannot_be_created_is_refused(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(
        ConfigError, match=r"output_dir, name: .*/file/tiny cannot be created: .*/file is a file, not a folder"
    ):
        run_pipeline(tiny_run(tmp_path, f'output_dir="{tmp_path}/file"'))


def test_a_run_folder_that_is_a_broken_link_is_refused(tmp_path):
    # (it does not exist, but nothing can be created there either)
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "tiny").symlink_to(tmp_path / "gone")
    with pytest.raises(ConfigError, match=r"output_dir, name: .*/runs/tiny is a link to nothing"):
        run_pipeline(tiny_run(tmp_path))


def test_a_top_level_harness_rl_cannot_train_on_is_refused_when_applied(tmp_path):
    """The orchestrator refuses a truncated sampler; given at the top level, it is refused at once."""
    with pytest.raises(ConfigError, match=r"rl.orchestrator: harness.sampling: .* temperature >= 1e-05"):
        tiny_run(tmp_path, "harness.sampling.temperature=0").resolved()


def test_the_top_level_tracking_is_every_role_s_with_the_run_folder_and_name(tmp_path):
    config = tiny_run(tmp_path, "tracking.tensorboard=false", 'tracking.wandb_project="mine"').resolved()
    tracking = config.tracking
    assert (tracking.dir, tracking.wandb_group) == (str(tmp_path / "runs" / "tiny"), "tiny")
    assert not tracking.tensorboard and tracking.wandb_project == "mine"
    assert config.midtrain.tracking == config.rl.trainer.tracking == config.rl.orchestrator.tracking == tracking


def test_dry_run_prints_the_config_as_it_would_run_and_runs_nothing(tmp_path):
    result = CliRunner().invoke(app, ["run", "--dry-run", *(f"--set={s}" for s in tiny_settings(tmp_path))])
    assert result.exit_code == 0, result.output
    printed = tomllib.loads(result.stdout)
    run_dir = str(tmp_path / "runs" / "tiny")
    for section in (printed["rl"]["orchestrator"]["harness"], printed["eval"]["harness"]):
        assert (section["max_turns"], section["max_turn_tokens"]) == (2, 12)  # the top-level [harness], not 50 / 512
        assert section["tokenizer_path"] == f"{run_dir}/midtrain/model"
    assert printed["rl"]["trainer"]["max_steps"] == printed["rl"]["orchestrator"]["max_batches"] == 2
    assert (
        printed["servers"]["serve"]["sync"]["store"]
        == printed["rl"]["orchestrator"]["weight_store"]
        == f"{run_dir}/weights"
    )
    assert PipelineConfig.model_validate(printed) == PipelineConfig.model_validate(printed).resolved()
    assert not (tmp_path / "runs").exists()


def test_dry_run_reports_what_would_stop_the_run(tmp_path):
    result = CliRunner().invoke(
        app, ["run", "--dry-run", *(f"--set={s}" for s in tiny_settings(tmp_path, f'eval.tasks.source="{MISSING}"'))]
    )
    assert result.exit_code == 1 and isinstance(result.exception, ConfigError)
    assert f"eval.tasks.source: no such file: {MISSING}" in str(result.exception)


def test_the_written_config_is_the_one_the_roles_run(tmp_path):
    """config.toml shows the harness, steps and stores the stages used, not the sections' own."""
    from whetstone.run.pipeline import Pipeline

    pipeline = Pipeline(tiny_run(tmp_path))
    pipeline.write_config()
    written = tomllib.loads((tmp_path / "runs" / "tiny" / "config.toml").read_text())
    role = json.loads(pipeline.orchestrator_config().model_dump_json())
    assert written["rl"]["orchestrator"]["harness"] == {k: v for k, v in role["harness"].items() if v is not None}
    assert written["eval"]["harness"]["max_turns"] == written["harness"]["max_turns"] == 2
    assert written["rl"]["trainer"]["max_steps"] == pipeline.trainer_config().max_steps == 2
    urls = ["http://127.0.0.1:1/v1", "http://127.0.0.1:2/v1"]
    pipeline.config = pipeline.config.resolved(urls)
    pipeline.write_config()  # as the pipeline does once its servers are up
    written = tomllib.loads((tmp_path / "runs" / "tiny" / "config.toml").read_text())
    assert written["rl"]["orchestrator"]["servers"] == written["eval"]["servers"] == urls


def test_server_ports_past_the_last_one_are_refused_by_base_port():
    with pytest.raises(ConfigError, match=r"servers: .*base_port 65535 \+ count 2 - 1 = port 65536, past 65535"):
        load_config(PipelineConfig, None, ["servers.base_port=65535"])
    assert load_config(PipelineConfig, None, ["servers.base_port=65534"]).servers.base_port == 65534
    assert load_config(PipelineConfig, None, ["servers.base_port=0", "servers.count=8"]).servers.count == 8


def test_vllm_options_whetstone_sets_itself_are_refused_as_the_config_loads():
    with pytest.raises(ConfigError, match=r"servers.vllm_args: --port: whetstone sets it for each vLLM server"):
        load_config(PipelineConfig, None, ['servers.vllm_args=["--port", "9000"]'])
    with pytest.raises(ConfigError, match=r"servers.vllm_args: --logprobs-mode: whetstone sets it"):
        load_config(PipelineConfig, None, ['servers.vllm_args=["--logprobs_mode=raw_logprobs"]'])
    args = ["--max-num-seqs", "4"]
    assert load_config(PipelineConfig, None, [f"servers.vllm_args={args}".replace("'", '"')]).servers.vllm_args == args


def test_an_evaluation_without_pass_at_1_is_refused_before_it_runs():
    with pytest.raises(ConfigError, match=r"eval.k = \[4\] must include 1: the run reports held-out pass@1"):
        load_config(PipelineConfig, None, ["eval.samples=4", "eval.k=[4]"])
    assert load_config(PipelineConfig, None, ["eval.k=[4]", "eval.samples=4", "rl_enabled=false"]).eval.k == [4]


def test_on_ray_the_cores_of_this_machine_are_not_checked(tmp_path):
    """The roles' cores are a local placement's: on Ray they run on the cluster's nodes."""
    cores = ("placement.trainer=[4096]", "placement.servers=[4096]", "placement.orchestrator=[4096]")
    with pytest.raises(ConfigError, match=r"placement.trainer: cores \[4096\]"):
        check_run_config(tiny_run(tmp_path, *cores).resolved())
    try:
        check_run_config(tiny_run(tmp_path, 'placement.backend="ray"', *cores).resolved())
    except ConfigError as err:  # only what else a machine without Ray lacks
        assert "cores" not in str(err)


def test_a_dry_run_of_mid_training_alone_checks_what_mid_training_needs(tmp_path):
    rl_only = (f'eval.tasks.source="{MISSING}"', "placement.trainer=[4096]")
    settings = tiny_settings(tmp_path, *rl_only)
    result = CliRunner().invoke(app, ["run", "--dry-run", "--midtrain-only", *(f"--set={s}" for s in settings)])
    assert result.exit_code == 0, result.output
    assert tomllib.loads(result.stdout)["eval"]["tasks"]["source"] == MISSING
    no_code = f'midtrain.data.directories=[{{path="{tmp_path}/no-code"}}]'
    settings = tiny_settings(tmp_path, *rl_only, no_code)
    result = CliRunner().invoke(app, ["run", "--dry-run", "--midtrain-only", *(f"--set={s}" for s in settings)])
    message = str(result.exception)
    assert result.exit_code == 1 and message.startswith("mid-training cannot start")
    assert "midtrain.data.directories[0].path" in message and "eval.tasks.source" not in message
    assert not (tmp_path / "runs").exists()


def test_sandboxes_that_cannot_be_created_here_are_refused_before_mid_training(tmp_path, monkeypatch):
    # without them every rollout of the evaluation before RL would fail, once mid-training is done
    from whetstone.envs.sandbox import SandboxUnavailableError
    from whetstone.run import preflight

    def no_namespaces():
        raise SandboxUnavailableError("bubblewrap cannot create a sandbox here: No permissions to create new namespace")

    monkeypatch.setattr(preflight, "check_bwrap", no_namespaces)
    with pytest.raises(ConfigError) as refused:
        run_pipeline(tiny_run(tmp_path))
    assert (
        "eval.rollout.sandbox, eval.rollout.reward.sandbox, rl.orchestrator.rollout.sandbox, "
        "rl.orchestrator.rollout.reward.sandbox: bubblewrap cannot create a sandbox here"
    ) in str(refused.value)
    assert not (tmp_path / "runs" / "tiny").exists()
    sandboxes = ("eval.rollout", "eval.rollout.reward", "rl.orchestrator.rollout", "rl.orchestrator.rollout.reward")
    trusted = [f"{key}.sandbox.unsandboxed=true" for key in sandboxes]
    check_run_config(tiny_run(tmp_path, *trusted).resolved())  # no sandbox asked for: nothing to create
    check_run_config(tiny_run(tmp_path).resolved(), midtrain_only=True)  # mid-training runs none
