import re

import pytest
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


@pytest.mark.parametrize(
    "token, problem",
    [
        ("pässwörd", "must be printable ASCII"),
        ("東京-token", "must be printable ASCII"),
        ("tab\\there", "must be printable ASCII"),
        (" leading", "must not start or end with a space"),
        ("trailing ", "must not start or end with a space"),
    ],
)
def test_a_token_no_client_can_send_is_refused_naming_the_field_not_the_value(tmp_path, token, problem):
    """The server would take no request at all: an HTTP header carries printable ASCII only (httpx
    and the `openai` client refuse other characters) and loses the spaces at its ends."""
    config = tmp_path / "serve.toml"
    config.write_text(f'model_path = "x"\nauth_token = "{token}"\n', encoding="utf-8")
    result = CliRunner().invoke(app, ["serve", str(config)])
    message = str(result.exception)
    assert isinstance(result.exception, ConfigError) and f"auth_token {problem}" in message
    secret = token.replace("\\t", "\t").strip()
    assert secret not in message and secret[:4] not in message
