from typer.testing import CliRunner

from whetstone.data.cli import app
from whetstone.errors import WhetstoneError

runner = CliRunner()


def test_build_prints_the_corpus_statistics(code_dir, tmp_path):
    config = tmp_path / "corpus.toml"
    config.write_text(
        f'stdlib = false\nvocab_size = 400\ncache_dir = "{tmp_path / "cache"}"\n\n'
        f'[[directories]]\npath = "{code_dir}"\n'
    )
    result = runner.invoke(app, ["build", str(config), "--set", "validation_fraction=0.2"])
    assert result.exit_code == 0, result.output
    for label in ("files", "duplicates removed", "tokens train / val", "bytes per token", "unigram entropy"):
        assert label in result.output
    assert "13 (0 documents skipped" in result.output
    again = runner.invoke(app, ["build", str(config), "--set", "validation_fraction=0.2"])
    assert again.exit_code == 0 and f"corpus: {tmp_path / 'cache'}/" in again.output


def test_bad_input_reaches_the_main_cli_as_a_whetstone_error(tmp_path):
    result = runner.invoke(app, ["build", "--set", "stdlib=false", "--set", f"cache_dir={tmp_path}"])
    assert isinstance(result.exception, WhetstoneError) and "no source files matched" in str(result.exception)
    result = runner.invoke(app, ["build", str(tmp_path / "missing.toml")])
    assert isinstance(result.exception, WhetstoneError) and "missing.toml does not exist" in str(result.exception)
