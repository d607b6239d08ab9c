import re

from typer.testing import CliRunner

from whetstone.errors import ConfigError
from whetstone.inference.cli import app


def test_serve_needs_a_model_path():
    result = CliRunner().invoke(app, ["serve"])
    assert isinstance(result.exception, ConfigError) and "model_path is not set" in str(result.exception)


def test_serve_names_a_bad_override(tmp_path):
    config = tmp_path / "serve.toml"
    config.write_text('model_path = "x"\n[engine]\nswap_policy = "sometimes"\n')
    result = CliRunner().invoke(app, ["serve", str(config), "--set", "engine.max_batch=0"])
    message = str(result.exception)
    assert isinstance(result.exception, ConfigError)
    assert "engine.swap_policy" in message and "engine.max_batch" in message


def test_help_lists_serve():
    result = CliRunner().invoke(app, ["--help"])
    # the command's row in the listing, not "serve" inside other text ("Inference server.")
    assert result.exit_code == 0 and re.search(r"^\W*serve\s+Serve a model", result.output, re.M)
