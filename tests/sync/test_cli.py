import signal
import subprocess
import sys
import time

import pytest
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from tests.sync.conftest import FakeTrainer, bit_identical, published
from whetstone.errors import ConfigError
from whetstone.sync import WeightStore
from whetstone.sync.cli import app

runner = CliRunner()


def test_publish_inspect_watch(tmp_path):
    store, checkpoint, out = str(tmp_path / "weights"), tmp_path / "ckpt.safetensors", tmp_path / "out.safetensors"
    trainer = FakeTrainer()
    for version in range(3):
        save_file({k: v.contiguous() for k, v in trainer.step().items()}, str(checkpoint))
        result = runner.invoke(app, ["publish", store, str(checkpoint)])
        assert result.exit_code == 0, result.output
        assert f"published version {version} ({'full' if version == 0 else 'delta'})" in result.output

    result = runner.invoke(app, ["inspect", store])
    assert result.exit_code == 0, result.output
    assert "delta" in result.output and "latest: 2" in result.output

    result = runner.invoke(app, ["watch", store, "--until", "2", "--save", str(out)])
    assert result.exit_code == 0, result.output
    assert "version (none) -> 2" in result.output
    assert bit_identical(load_file(str(out)), published(trainer.state))


def test_bad_checkpoint_is_a_clear_error(tmp_path):
    (tmp_path / "bad.safetensors").write_bytes(b"not a checkpoint")
    result = runner.invoke(app, ["publish", str(tmp_path / "w"), str(tmp_path / "bad.safetensors")])
    assert result.exit_code != 0 and "not a readable safetensors file" in str(result.exception)
    # autocast publishing needs to know the embedding tables, which a bare state dict does not say
    result = runner.invoke(
        app, ["publish", str(tmp_path / "w"), str(tmp_path / "bad.safetensors"), "--dtype", "autocast"]
    )
    assert result.exit_code != 0 and "--dtype autocast needs the model's embedding tables" in str(result.exception)
    result = runner.invoke(app, ["publish", str(tmp_path / "w"), str(tmp_path / "missing.safetensors")])
    assert "does not exist" in str(result.exception)


@pytest.mark.parametrize(
    "command, named",
    [
        (["publish", "STORE", "CKPT", "--dtype", "float64"], "--dtype 'float64' is not one of bfloat16, float16, "),
        (["publish", "STORE", "CKPT", "--keyframe-interval", "0"], "--keyframe-interval: Input should be greater"),
        (["watch", "STORE", "--poll-interval", "-1"], "--poll-interval: Input should be greater than 0 (got -1.0)"),
    ],
)
def test_a_bad_option_is_a_config_error_naming_it(tmp_path, command, named):
    checkpoint = tmp_path / "ckpt.safetensors"
    save_file({k: v.contiguous() for k, v in FakeTrainer().step().items()}, str(checkpoint))
    paths = {"STORE": str(tmp_path / "weights"), "CKPT": str(checkpoint)}
    result = runner.invoke(app, [paths.get(arg, arg) for arg in command])
    assert isinstance(result.exception, ConfigError) and named in str(result.exception), result.exception
    assert not (tmp_path / "weights").exists()


def test_inspect_an_empty_store(tmp_path):
    result = runner.invoke(app, ["inspect", str(tmp_path)])
    assert result.exit_code == 0 and "no versions" in result.output


def test_watch_goes_on_after_a_store_hiccup(tmp_path, monkeypatch):
    store, checkpoint = str(tmp_path / "weights"), tmp_path / "ckpt.safetensors"
    save_file({k: v.contiguous() for k, v in FakeTrainer().step().items()}, str(checkpoint))
    assert runner.invoke(app, ["publish", store, str(checkpoint)]).exit_code == 0
    head, calls = WeightStore.head, []

    def flaky_head(self):
        calls.append(1)
        if len(calls) == 1:
            raise OSError("connection reset")
        return head(self)

    monkeypatch.setattr(WeightStore, "head", flaky_head)
    result = runner.invoke(app, ["watch", store, "--until", "0", "--timeout", "10", "--poll-interval", "0.01"])
    assert result.exit_code == 0, result.output
    assert len(calls) >= 2 and "version (none) -> 0" in result.output


SAVE_THAT_HANGS = """
import sys, time
import safetensors.torch
from whetstone.cli import main

def save_file(tensors, path):  # a save that takes its time: half written when the signal comes
    with open(path, "wb") as file:
        file.write(b"half")
    time.sleep(120)

safetensors.torch.save_file = save_file
main(["sync", "watch", *sys.argv[1:]])
"""


def test_sigterm_in_a_save_leaves_no_temporary_file_and_exits_143(tmp_path):
    store, checkpoint, out = str(tmp_path / "weights"), tmp_path / "ckpt.safetensors", tmp_path / "out.safetensors"
    save_file({k: v.contiguous() for k, v in FakeTrainer().step().items()}, str(checkpoint))
    assert runner.invoke(app, ["publish", store, str(checkpoint)]).exit_code == 0
    process = subprocess.Popen(
        [sys.executable, "-c", SAVE_THAT_HANGS, store, "--save", str(out)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 60
        while not any(path.stat().st_size for path in tmp_path.glob(".out.safetensors.*.tmp")):
            assert process.poll() is None and time.monotonic() < deadline, "no save began"
            time.sleep(0.05)
        process.send_signal(signal.SIGTERM)
        _, err = process.communicate(timeout=30)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert sorted(path.name for path in tmp_path.iterdir()) == ["ckpt.safetensors", "weights"]  # nor a half save
    assert process.returncode == 128 + signal.SIGTERM and err.rstrip().endswith("stopped by SIGTERM"), err
