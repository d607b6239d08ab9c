from pathlib import Path

import pytest
from pydantic import model_validator

from whetstone.config import Config, dump_toml, expand_path, load_config, parse_override, write_toml
from whetstone.errors import ConfigError


class Inner(Config):
    lr: float = 1e-3
    """Learning rate."""
    name: str = "tiny"
    """A name."""


class Outer(Config):
    steps: int = 10
    """Steps."""
    inner: Inner = Inner()
    """Inner section."""


def test_defaults_and_docstrings():
    cfg = load_config(Outer)
    assert cfg.steps == 10 and cfg.inner.lr == 1e-3
    assert Outer.model_fields["steps"].description == "Steps."


def test_toml_file_and_overrides(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text("steps = 5\n[inner]\nlr = 0.5\n")
    cfg = load_config(Outer, path, ["inner.name=big-run", "steps=7"])
    assert (cfg.steps, cfg.inner.lr, cfg.inner.name) == (7, 0.5, "big-run")


def test_unknown_key_is_named(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text("[inner]\nlrr = 0.5\n")
    with pytest.raises(ConfigError, match=r"inner\.lrr"):
        load_config(Outer, path)


def test_wrong_type_is_named():
    with pytest.raises(ConfigError, match=r"steps: .*got 'many'"):
        load_config(Outer, None, ["steps=many"])


def test_bad_toml_and_missing_file(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text("steps = = 1\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(Outer, path)
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(Outer, tmp_path / "nope.toml")
    with pytest.raises(ConfigError, match="KEY=VALUE"):
        parse_override("steps")


def test_a_config_path_that_is_no_text_file_is_named(tmp_path, monkeypatch):
    with pytest.raises(ConfigError, match=f"config file {tmp_path} is a directory"):
        load_config(Outer, tmp_path)
    binary = tmp_path / "c.toml"
    binary.write_bytes(b"steps = 1\n\xff\xfe\x00")
    with pytest.raises(ConfigError, match=f"config file {binary} is not UTF-8 text"):
        load_config(Outer, binary)

    def refuse(self, *args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(Path, "read_text", refuse)  # root reads any file, so no chmod here
    with pytest.raises(ConfigError, match=f"config file {binary} is not readable: Permission denied"):
        load_config(Outer, binary)


class Checked(Config):
    low: int = 0
    """Low."""
    high: int = 1
    """High."""

    @model_validator(mode="after")
    def _ordered(self):
        if self.low > self.high:
            raise ValueError(f"low={self.low} must not exceed high={self.high}")
        return self


class Holder(Config):
    steps: int = 1
    """Steps."""
    checked: Checked = Checked()
    """A section with a check across its fields."""

    @model_validator(mode="after")
    def _enough_steps(self):
        if self.steps < self.checked.high:
            raise ValueError(f"steps={self.steps} must be at least checked.high={self.checked.high}")
        return self


def test_a_check_across_fields_shows_its_message_not_the_whole_input():
    with pytest.raises(ConfigError) as caught:
        load_config(Holder, None, ["checked.low=5"])
    assert str(caught.value).splitlines() == [
        "invalid config (defaults + overrides):",
        "  checked: low=5 must not exceed high=1",
    ]
    with pytest.raises(ConfigError) as caught:
        load_config(Holder, None, ["steps=0", "checked.high=3"])
    assert str(caught.value).splitlines() == [
        "invalid config (defaults + overrides):",
        "  steps=0 must be at least checked.high=3",
    ]


def test_dump_round_trip(tmp_path):
    cfg = load_config(Outer, None, ["inner.name=x y", "steps=3"])
    path = tmp_path / "dump.toml"
    path.write_text(dump_toml(cfg))
    assert load_config(Outer, path) == cfg


def test_a_partial_section_keeps_the_defaults_of_its_parent():
    from whetstone.config import Config, load_config

    class Inner(Config):
        a: int = 1
        """A."""
        b: int = 2
        """B."""

    class Outer(Config):
        inner: Inner = Inner(a=10)
        """A section whose default differs from Inner()."""

    assert load_config(Outer, None, ["inner.b=5"]).inner == Inner(a=10, b=5)  # not Inner(a=1, b=5)
    assert load_config(Outer, None, ["inner.a=3"]).inner == Inner(a=3, b=2)
    assert Outer.model_validate({"inner": Inner(a=7)}).inner.a == 7  # an instance is taken as is


def test_dict_keys_that_are_not_bare_toml_keys_survive_the_round_trip(tmp_path):
    from whetstone.training.config import OptimizerConfig

    cfg = OptimizerConfig(lr_multipliers={"norm.weight": 30.0, "layers.*.mlp gate": 2.0})
    path = tmp_path / "opt.toml"
    path.write_text(dump_toml(cfg))
    assert load_config(OptimizerConfig, path) == cfg


class Labels(Config):
    tag: str | None = None
    """An optional name."""
    env: dict[str, str] = {}
    """Variables by name."""
    seed: int | None = None
    """An optional number."""


def test_an_override_of_a_text_field_is_its_text_whatever_toml_makes_of_it():
    texts = ["123", "true", "2024-01-01", "1e3", "[1, 2]", "my-run"]
    for text in texts:
        assert load_config(Outer, None, [f"inner.name={text}"]).inner.name == text
        labels = load_config(Labels, None, [f"tag={text}", f"env.X={text}"])
        assert (labels.tag, labels.env) == (text, {"X": text})
    assert load_config(Outer, None, ['inner.name="quoted"']).inner.name == "quoted"  # a TOML string is its value


def test_a_boolean_for_a_number_is_refused():
    with pytest.raises(ConfigError, match=r"override 'steps=true': steps takes an integer, not a boolean"):
        load_config(Outer, None, ["steps=true"])
    with pytest.raises(ConfigError, match=r"inner.lr takes a number, not a boolean"):
        load_config(Outer, None, ["inner.lr=false"])
    with pytest.raises(ConfigError, match=r"seed takes an integer"):
        load_config(Labels, None, ["seed=true"])
    assert load_config(Labels, None, ["seed=3"]).seed == 3


def test_control_characters_survive_the_round_trip(tmp_path):
    text = "".join(chr(code) for code in range(128)) + "é\u2028"
    cfg = Labels(tag=text, env={"PS1": "a\rb", "key\x1b[0m": "\x00"})
    path = tmp_path / "labels.toml"
    path.write_text(dump_toml(cfg))
    assert load_config(Labels, path) == cfg


def test_a_path_is_expanded_as_a_shell_would_and_an_unset_variable_is_named(monkeypatch):
    """A TOML value or a `--set` value never passes through a shell: whetstone expands it."""
    monkeypatch.setenv("HOME", "/home/someone")
    monkeypatch.setenv("RUNS", "/data/runs")
    monkeypatch.delenv("WHETSTONE_UNSET", raising=False)
    assert expand_path("~/batches") == Path("/home/someone/batches")
    assert expand_path("$RUNS/a") == expand_path("${RUNS}/a") == Path("/data/runs/a")
    assert expand_path(Path("$HOME/x")) == Path("/home/someone/x")
    assert expand_path("runs/a") == Path("runs/a")  # relative: against the working directory
    assert expand_path("cost$") == Path("cost$")  # a `$` naming no variable stays
    with pytest.raises(
        ConfigError, match=r"path '\$WHETSTONE_UNSET/x': the environment variable \$WHETSTONE_UNSET is not set"
    ):
        expand_path("$WHETSTONE_UNSET/x")
    with pytest.raises(ConfigError, match="there is no user 'no-such-user-x' to expand ~no-such-user-x"):
        expand_path("~no-such-user-x/runs")


def test_run_folders_expand_home_and_variables(monkeypatch):
    from whetstone.midtrain.config import MidtrainConfig
    from whetstone.run.config import PipelineConfig

    monkeypatch.setenv("HOME", "/home/someone")
    monkeypatch.setenv("RUNS", "/data/runs")
    assert MidtrainConfig.model_validate({"run": {"output_dir": "$RUNS", "name": "m"}}).run.run_dir == Path(
        "/data/runs/m"
    )
    assert PipelineConfig.model_validate({"output_dir": "~/runs", "name": "p"}).run_dir == Path("/home/someone/runs/p")


def test_a_written_config_keeps_its_secrets_and_is_readable_by_its_owner_only(tmp_path):
    """A config file holds what runs it again, secrets included (a store URL's password), so it
    is 0600 whatever the umask, even where it replaces a file others could read."""
    import os
    import stat

    cfg = Outer(inner=Inner(name="postgresql://loop:s3cret@db/feedback"))
    path = tmp_path / "config.toml"
    path.write_text("steps = 1\n")
    path.chmod(0o644)
    umask = os.umask(0o022)
    try:
        write_toml(path, cfg)
    finally:
        os.umask(umask)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert load_config(Outer, path) == cfg


def test_what_leaves_the_machine_shows_no_secret(tmp_path, monkeypatch):
    from whetstone.config import without_secrets
    from whetstone.utils import metrics
    from whetstone.utils.tracking import TrackingConfig

    dumped = {
        "feedback_store": "postgresql://loop:s3/cr@t@db:5432/feedback",
        "servers": [{"auth_token": "tok", "store": "runs/weights"}],
        "serve": {"auth_token": "", "port": 8000},
    }
    assert without_secrets(dumped) == {
        "feedback_store": "postgresql://loop:***@db:5432/feedback",
        "servers": [{"auth_token": "***", "store": "runs/weights"}],
        "serve": {"auth_token": "", "port": 8000},  # none set: nothing to hide
    }
    seen = []
    monkeypatch.setattr(metrics, "open_sinks", lambda tracking, role, folder, config: seen.append(config) or [])

    class Secret(Config):
        auth_token: str = "tok"

    metrics.MetricsWriter(tmp_path / "m.jsonl", TrackingConfig(), run_config=Secret())
    assert seen == [{"auth_token": "***"}]


def test_an_override_with_spaces_around_its_equals_sign_has_its_value_without_them():
    """`--set "output_dir = /data/runs"` is the path /data/runs, not " /data/runs", a folder
    named " " in the working directory."""
    from whetstone.run.config import PipelineConfig

    cfg = load_config(Outer, None, ["inner.name = big-run", "steps = 7"])
    assert (cfg.inner.name, cfg.steps) == ("big-run", 7)
    assert load_config(Labels, None, ["tag = 123 "]).tag == "123"
    assert load_config(Labels, None, ['tag = " padded "']).tag == " padded "  # a TOML string is its value
    run = load_config(PipelineConfig, None, ["output_dir = /data/runs", "name=r"])
    assert run.run_dir == Path("/data/runs/r")


def test_a_quoted_part_of_an_override_key_is_one_key_dots_and_all():
    from whetstone.training.config import OptimizerConfig

    labels = load_config(Labels, None, ['env."A.B"=x', "env . C = y", "env.é=z"])  # é: no bare TOML key
    assert labels.env == {"A.B": "x", "C": "y", "é": "z"}
    optimizer = load_config(OptimizerConfig, None, ['lr_multipliers."norm.weight"=30'])
    assert optimizer.lr_multipliers == {"norm.weight": 30.0}


def test_a_toml_file_with_a_byte_order_mark_is_read(tmp_path):
    """Some Windows editors begin a UTF-8 file with one; tomllib alone calls it invalid TOML."""
    path = tmp_path / "c.toml"
    path.write_bytes('\ufeffsteps = 5\n[inner]\nname = "é"\n'.encode())
    assert load_config(Outer, path) == Outer(steps=5, inner=Inner(name="é"))


def test_an_empty_override_unsets_an_optional_field_and_leaves_others_a_string():
    """TOML has no null: `key=` is how an override gives an optional field None again."""
    from whetstone.sync.config import SyncConfig

    base = load_config(SyncConfig, overrides=["endpoint_url=http://localhost:9000"])
    assert base.endpoint_url == "http://localhost:9000"
    assert load_config(SyncConfig, overrides=["endpoint_url=http://x", "endpoint_url="]).endpoint_url is None
    assert load_config(SyncConfig, overrides=['endpoint_url=""']).endpoint_url == ""
    assert parse_override("name=", NamedConfig) == (["name"], "")  # not optional: the empty string


class NamedConfig(Config):
    name: str = "x"


def test_a_config_error_shows_no_secret_it_was_given():
    # config errors end up in logs: a secret key's value is shown as ***, a URL without its password
    class Secrets(Config):
        api_token: int = 0
        """A secret (by its name)."""
        database: int = 0
        """A URL, which may hold a password."""

    with pytest.raises(ConfigError) as raised:
        load_config(Secrets, None, ['api_token="s3cret-value"', 'database="postgresql://u:hunter2@h/db"'])
    message = str(raised.value)
    assert "s3cret-value" not in message and "hunter2" not in message
    assert "api_token: " in message and "(got '***')" in message
    assert "(got 'postgresql://u:***@h/db')" in message
