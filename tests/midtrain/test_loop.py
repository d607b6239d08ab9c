"""The whole run at tiny scale: real corpus, real model, checkpoints, resume, export."""

import hashlib
import json
import os
import re
from pathlib import Path

import pytest
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from tests.utils.tracking_support import event_scalars, jsonl_scalars, use_offline_wandb, wandb_history
from whetstone.errors import CheckpointError, ConfigError, WhetstoneError
from whetstone.midtrain import loop
from whetstone.midtrain.loop import train
from whetstone.model import Transformer
from whetstone.model.hf import load_hf, save_hf
from whetstone.tokenizer import Tokenizer
from whetstone.training.checkpoint import list_checkpoints, read_state
from whetstone.utils.metrics import read_metrics


def final_weights(summary) -> dict[str, torch.Tensor]:
    return load_file(f"{summary['run_dir']}/checkpoints/step_{summary['step']:08d}/model.safetensors")


def crash_in_step(monkeypatch, crashing: int) -> None:
    """Make the run die in step `crashing` (the records before it written, no checkpoint), as a
    killed process would leave its folder."""
    step = loop._step

    def step_or_crash(session):
        if session.state.step + 1 == crashing:
            raise RuntimeError(f"killed in step {crashing}")
        return step(session)

    monkeypatch.setattr(loop, "_step", step_or_crash)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_resumed_run_is_bit_identical_to_a_straight_run(make_config, monkeypatch, dtype):
    straight = train(make_config(f"run.dtype={dtype}", "run.name=straight", "run.grad_accum=2"))
    halves = make_config(f"run.dtype={dtype}", "run.name=halves", "run.grad_accum=2")
    first = train(halves, stop_at_step=4)
    assert (first["step"], first["finished"], first["model_dir"]) == (4, False, None)
    # resumed, it dies in step 7: steps 5 and 6 are recorded after the checkpoint of step 4
    metrics = Path(first["run_dir"]) / "metrics.jsonl"
    before = metrics.read_bytes()
    crash_in_step(monkeypatch, 7)
    with pytest.raises(RuntimeError, match="killed in step 7"):
        train(halves)
    assert [r["step"] for r in read_metrics(metrics)][-2:] == [5, 6]
    monkeypatch.undo()
    second = train(halves)
    assert second["resumed_from"].endswith("step_00000004")

    a, b = final_weights(straight), final_weights(second)
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name
    assert second["val_loss"] == straight["val_loss"]
    assert second["tokens"] == straight["tokens"] == 8 * 2 * 4 * 32
    # one record per step and evaluation, the straight run's numbers; those up to the checkpoint as written
    assert metrics.read_bytes().startswith(before)
    ignored = ("time", "tokens_per_s")
    records = [{k: v for k, v in r.items() if k not in ignored} for r in read_metrics(metrics)]
    expected = [
        {k: v for k, v in r.items() if k not in ignored}
        for r in read_metrics(metrics.parent.parent / "straight" / "metrics.jsonl")
    ]
    assert records == expected


@pytest.mark.parametrize("position", ["rows", "batches of the checkpoint's size"])
def test_a_resume_with_another_batch_size_reads_the_rows_that_follow(make_config, position):
    # 8 rows a step either way: two micro-batches of 4, then one of 8. fp32 and no load-balancing
    # loss (taken per micro-batch), so the resumed steps are the straight run's, to rounding.
    settings = ("run.dtype=float32", "model.router_aux_loss_coef=0.0", "run.steps=4")
    straight = train(make_config(*settings, "run.name=straight", "run.batch_size=8"))
    first = train(make_config(*settings, "run.name=changed", "run.batch_size=4", "run.grad_accum=2"), stop_at_step=2)
    state_file = Path(first["run_dir"]) / "checkpoints" / "step_00000002" / "state.json"
    record = json.loads(state_file.read_text())
    assert record["data"]["next_row"] == 16
    if position != "rows":  # a checkpoint that counted micro-batches of 4 rows
        del record["data"]["next_row"]
        state_file.write_text(json.dumps({**record, "data": {**record["data"], "next_batch": 4}}))
    changed = train(make_config(*settings, "run.name=changed", "run.batch_size=8"))
    assert changed["resumed_from"].endswith("step_00000002")

    def losses(summary):
        return [r["loss"] for r in read_metrics(f"{summary['run_dir']}/metrics.jsonl") if "loss" in r]

    assert losses(changed) == pytest.approx(losses(straight), rel=1e-5)
    final = read_state(Path(changed["run_dir"]) / "checkpoints" / "step_00000004")
    assert final["data"]["next_row"] == 32 and "next_batch" not in final["data"]


def test_a_data_position_that_is_not_a_count_is_refused(make_config):
    first = train(make_config("run.steps=4"), stop_at_step=2)
    state_file = Path(first["run_dir"]) / "checkpoints" / "step_00000002" / "state.json"
    record = json.loads(state_file.read_text())
    state_file.write_text(json.dumps({**record, "data": {**record["data"], "next_row": -8}}))
    with pytest.raises(CheckpointError, match=r"state.json is corrupt: data.next_row is -8, not a count"):
        train(make_config("run.steps=4"))


def test_auto_dtype_is_resolved_and_recorded(make_config, tmp_path, monkeypatch):
    from whetstone.utils import runtime

    monkeypatch.setattr(runtime, "native_bf16", lambda: False)
    summary = train(make_config("run.dtype=auto", "run.steps=3"))
    assert summary["dtype"] == "float32"
    assert 'dtype = "float32"' in (tmp_path / "runs" / "midtrain" / "config.toml").read_text()


def test_auto_resumes_in_the_dtype_the_checkpoint_was_trained_in(make_config, monkeypatch):
    from whetstone.utils import runtime

    straight = train(make_config("run.dtype=float32", "run.name=straight"))
    train(make_config("run.dtype=float32", "run.name=halves"), stop_at_step=4)
    monkeypatch.setattr(runtime, "native_bf16", lambda: True)  # `auto` alone would now pick bf16
    second = train(make_config("run.dtype=auto", "run.name=halves"))
    assert second["dtype"] == "float32"
    a, b = final_weights(straight), final_weights(second)
    assert all(torch.equal(a[name], b[name]) for name in a)


def test_metrics_summary_and_hf_export(make_config, tmp_path):
    summary = train(make_config())
    run_dir = tmp_path / "runs" / "midtrain"
    records = read_metrics(run_dir / "metrics.jsonl")
    steps = [r for r in records if "loss" in r]
    evals = [r for r in records if "val_loss" in r]
    assert [r["step"] for r in steps] == list(range(1, 9))
    assert {"tokens", "lr", "grad_norm", "aux_loss", "tokens_per_s"} <= steps[0].keys()
    assert [r["step"] for r in evals] == [4, 8] and evals[-1]["val_loss"] == summary["val_loss"]
    assert steps[-1]["loss"] < steps[0]["loss"]
    assert summary["finished"] and json.loads((run_dir / "summary.json").read_text()) == summary
    assert summary["unigram_entropy"] > 0 and summary["val_unigram_cross_entropy"] > 0
    assert (run_dir / "config.toml").stat().st_mode & 0o777 == 0o600  # a config holds its secrets as given

    exported = load_hf(summary["model_dir"])
    weights = final_weights(summary)
    for name, tensor in exported.state_dict().items():
        if name in weights:
            assert torch.equal(tensor, weights[name]), name
    assert (run_dir / "model" / "tokenizer.json").exists()


def test_the_metrics_also_go_to_tensorboard_at_the_steps_of_the_jsonl(make_config, tmp_path):
    train(make_config("run.steps=4", "run.eval_interval=2"))
    run_dir = tmp_path / "runs" / "midtrain"
    records = read_metrics(run_dir / "metrics.jsonl")
    events = event_scalars(run_dir / "tensorboard" / "midtrain")
    for key in ("loss", "lr", "grad_norm", "tokens", "tokens_per_s", "val_loss"):  # tokens: train and eval records
        assert events[key] == jsonl_scalars(records, key) != [], key


def test_an_offline_wandb_run_gets_the_metrics_at_the_steps_of_the_jsonl(make_config, tmp_path, monkeypatch):
    use_offline_wandb(monkeypatch, tmp_path)
    train(make_config("run.steps=4", "run.eval_interval=2", "tracking.wandb=true", "tracking.wandb_mode=offline"))
    run_dir = tmp_path / "runs" / "midtrain"
    rows: dict[int, dict] = {}  # a step's training and evaluation records are one W&B row
    for record in read_metrics(run_dir / "metrics.jsonl"):
        rows.setdefault(record["step"], {}).update({k: v for k, v in record.items() if k not in ("step", "time")})
    assert wandb_history(run_dir) == rows and set(rows) == {1, 2, 3, 4}


def test_a_finished_run_resumes_to_the_same_summary_without_training(make_config):
    config = make_config("run.steps=4", "run.eval_interval=2")
    first = train(config)
    again = train(config)
    assert again["resumed_from"].endswith("step_00000004")
    assert again["val_loss"] == first["val_loss"] and again["tokens"] == first["tokens"]
    fewer = make_config("run.steps=3", "run.eval_interval=2")  # the same run, now asked for fewer steps
    with pytest.raises(ConfigError, match="step_00000004 is past run.steps = 3: resuming would use its later weights"):
        train(fewer)


def test_a_fresh_start_sets_an_older_longer_run_aside_instead_of_mixing_with_it(make_config):
    older = train(make_config("run.steps=8", "run.seed=1"))
    run_dir = Path(older["run_dir"])
    fresh = train(make_config("run.steps=6", "run.seed=2", "run.resume=false", "run.checkpoint_interval=2"))
    assert fresh["resumed_from"] is None
    checkpoints = list_checkpoints(run_dir / "checkpoints")
    assert [(p.name, read_state(p)["config"]["run"]["seed"]) for p in checkpoints] == [
        ("step_00000004", 2),
        ("step_00000006", 2),
    ]
    assert [r["step"] for r in read_metrics(run_dir / "metrics.jsonl") if "loss" in r] == list(range(1, 7))
    (previous,) = (run_dir / "previous").iterdir()  # the older run, kept whole
    assert [p.name for p in list_checkpoints(previous / "checkpoints")] == ["step_00000004", "step_00000008"]
    assert json.loads((previous / "summary.json").read_text())["step"] == 8 and (previous / "model").is_dir()
    resumed = train(make_config("run.steps=10", "run.seed=2", "run.checkpoint_interval=2"))
    assert resumed["resumed_from"].endswith("step_00000006")  # the fresh run goes on, not the older one


def test_wall_time_limit_checkpoints_exports_and_stops_early(make_config):
    config = make_config("run.max_wall_time=1e-9")
    summary = train(config)
    assert (summary["step"], summary["stopped_early"], summary["finished"]) == (1, True, False)
    assert summary["model_dir"] and summary["val_loss"] is not None
    assert train(config.model_copy(update={"run": config.run.model_copy(update={"max_wall_time": 0})}))["finished"]


def from_checkpoint(config, folder, **data):
    """`config` set to start from the HF folder `folder` (no model section of its own)."""
    run = config.run.model_copy(update={"init_from": str(folder)})
    return config.model_copy(
        update={"model": type(config.model)(), "run": run, "data": config.data.model_copy(update=data)}
    )


def test_continue_training_from_an_exported_hf_folder(make_config):
    base = train(make_config("run.name=base", "run.steps=4", "run.eval_interval=2"))
    continued = train(from_checkpoint(make_config("run.name=continued"), base["model_dir"]))
    assert continued["finished"] and continued["val_loss"] < base["val_loss"]
    assert continued["parameters"] == base["parameters"]


def test_a_model_section_that_disagrees_with_init_from_is_named(make_config):
    base = train(make_config("run.name=base", "run.steps=4", "run.eval_interval=2"))
    agreeing = make_config(
        "run.name=agreeing", "run.steps=4", "run.eval_interval=2", f"run.init_from={base['model_dir']}"
    )
    assert train(agreeing)["finished"]  # the tiny model section matches the exported config.json
    with pytest.raises(ConfigError, match=r"model.hidden_size = 48, but run.init_from .* has 32"):
        train(make_config("model.hidden_size=48", f"run.init_from={base['model_dir']}"))


def test_init_from_an_unsupported_architecture_is_named(make_config, tmp_path):
    base = train(make_config("run.name=base", "run.steps=4", "run.eval_interval=2"))
    folder = tmp_path / "gelu-model"
    folder.mkdir()
    hf_config = json.loads((tmp_path / "runs" / "base" / "model" / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**hf_config, "hidden_act": "gelu"}))
    with pytest.raises(CheckpointError, match=r"gelu-model/config.json.*hidden_act"):
        train(from_checkpoint(make_config("run.name=other"), folder, tokenizer=base["model_dir"]))


def test_rows_longer_than_the_models_context_are_refused_before_any_work(make_config, tmp_path):
    with pytest.raises(
        ConfigError, match=r"data.seq_len \(64\) is longer than the model's max_position_embeddings \(32\)"
    ):
        train(make_config("data.seq_len=64", "model.max_position_embeddings=32"))
    assert not (tmp_path / "runs" / "midtrain" / "checkpoints").exists()


def test_a_model_vocabulary_smaller_than_the_tokenizer_is_named(make_config):
    with pytest.raises(
        ConfigError,
        match=r"the tokenizer .*/tokenizer/tokenizer.json of the corpus \(trained on it: data.vocab_size\) has \d+ "
        r"token ids, but the model's vocab_size \(model.vocab_size\) is only 100: .* Set model.vocab_size to at "
        r"least \d+, or lower data.vocab_size",
    ):
        train(make_config("model.vocab_size=100"))


def test_an_init_from_folder_whose_tokenizer_outgrows_its_model_is_named(make_config, tmp_path):
    """The folder's own tokenizer tokenizes the corpus: an id past the embedding would fail mid-run."""
    config = make_config("run.name=small")
    tokenizer = tmp_path / "tokenizer"
    Tokenizer.train([json.dumps(config.model_dump(mode="json"))] * 50, vocab_size=300).save(tokenizer)
    folder = save_hf(Transformer(config.model.model_copy(update={"vocab_size": 64})), tmp_path / "small", tokenizer)
    with pytest.raises(
        ConfigError,
        match=rf"the tokenizer .*/tokenizer/tokenizer.json of the corpus \(from {folder}\) has \d+ token ids, but "
        rf"the model's vocab_size \({folder / 'config.json'}: run.init_from\) is only 64",
    ):
        train(from_checkpoint(config, folder))


def test_a_checkpoint_that_does_not_fit_the_config_is_named(make_config):
    train(make_config("run.steps=4", "run.eval_interval=2"))
    with pytest.raises(CheckpointError, match=r"step_00000004/model.safetensors: tensor '.*' has shape"):
        train(make_config("run.steps=8", "model.hidden_size=48"))


def test_an_empty_corpus_is_named(make_config, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(WhetstoneError, match="corpus is empty"):
        train(make_config(f'data.directories=[{{path="{empty}"}}]'))
    assert not (tmp_path / "runs").exists()


def test_resuming_with_another_tokenizer_is_refused_naming_both(make_config, tmp_path):
    first = train(make_config("run.steps=4"))
    run_dir = Path(first["run_dir"])
    trained_with = hashlib.sha256((run_dir / "model" / "tokenizer.json").read_bytes()).hexdigest()
    assert read_state(run_dir / "checkpoints" / "step_00000004")["data"]["tokenizer_sha256"] == trained_with
    before = sorted(str(p.relative_to(run_dir)) for p in run_dir.rglob("*"))
    with pytest.raises(
        ConfigError,
        match=rf"step_00000004 was trained with another tokenizer \(tokenizer.json sha256 {trained_with[:16]}\) "
        r"than this run's corpus tokenizer \(tokenizer.json sha256 \w{16}\): its weights would go on training on "
        r"other token ids\. Resume with the data settings the checkpoint was trained with "
        r"\(data.vocab_size = 320 -> 300\), or train a new run: another run.name, or run.resume = false",
    ):
        train(make_config("run.steps=8", "data.vocab_size=300"))
    assert sorted(str(p.relative_to(run_dir)) for p in run_dir.rglob("*")) == before  # nothing written
    assert train(make_config("run.steps=8"))["resumed_from"].endswith("step_00000004")  # the same tokenizer resumes


@pytest.mark.parametrize("where", ["output_dir", "run folder", "checkpoints", "model", "read-only checkpoints"])
def test_a_run_folder_that_cannot_be_written_is_refused_before_any_work(make_config, tmp_path, monkeypatch, where):
    runs = tmp_path / "runs"
    run_dir = runs / "midtrain"
    bad = {
        "output_dir": runs,
        "run folder": run_dir,
        "checkpoints": run_dir / "checkpoints",
        "model": run_dir / "model",
        "read-only checkpoints": run_dir / "checkpoints",
    }[where]
    bad.parent.mkdir(parents=True, exist_ok=True)
    if where == "read-only checkpoints":  # as root a mode does not stop writes: os.access says what would
        bad.mkdir()
        real_access = os.access
        monkeypatch.setattr(os, "access", lambda path, mode: Path(path) != bad and real_access(path, mode))
        problem = f"{bad} is not writable"
    else:
        bad.write_text("a file")
        problem = f"{bad} is a file, not a folder"
        if where == "output_dir":
            problem = f"{run_dir} cannot be created: {runs} is a file, not a folder"
    with pytest.raises(
        ConfigError, match=re.escape(f"{problem}: the run writes {run_dir} (run.output_dir / run.name)")
    ):
        train(make_config("run.steps=4"))
    assert not (run_dir / "metrics.jsonl").exists()


def test_a_damaged_newest_checkpoint_is_refused_naming_the_older_complete_one(make_config):
    config = make_config("run.steps=4", "run.checkpoint_interval=2", "run.keep_checkpoints=3")
    checkpoints = Path(train(config)["run_dir"]) / "checkpoints"
    newest = checkpoints / "step_00000004"
    (newest / "model.safetensors").write_bytes((newest / "model.safetensors").read_bytes()[:1000])  # truncated
    longer = make_config("run.steps=6", "run.checkpoint_interval=2", "run.keep_checkpoints=3")
    with pytest.raises(
        CheckpointError,
        match=r"step_00000004/model.safetensors is corrupt \(sha256 mismatch\)\. step_00000004 is the run's newest "
        r"checkpoint\. Older complete checkpoints in .*checkpoints: step_00000002\. The run does not fall back by "
        r"itself .*: move .*step_00000004 out of .*checkpoints to resume from step_00000002",
    ):
        train(longer)
    assert [p.name for p in list_checkpoints(checkpoints)] == ["step_00000002", "step_00000004"]  # nothing lost
    newest.rename(checkpoints.parent / "damaged-step_00000004")
    assert train(longer)["resumed_from"].endswith("step_00000002")  # what the message says works


def test_temporary_folders_of_a_crashed_save_are_deleted_when_the_run_starts(make_config):
    checkpoints = Path(train(make_config("run.steps=4"))["run_dir"]) / "checkpoints"
    stale = checkpoints / ".step_00000006.x1y2z3.tmp"  # a save killed midway
    stale.mkdir()
    (stale / "model.safetensors").write_bytes(b"\0" * 1000)
    train(make_config("run.steps=6", "run.checkpoint_interval=2"))
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step_00000004", "step_00000006"]


def test_an_export_on_a_full_disk_is_a_clear_error_and_keeps_the_checkpoint(make_config, monkeypatch):
    from whetstone.model import hf

    def disk_full(*args, **kwargs):
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(hf, "save_file", disk_full)
    config = make_config("run.steps=4")
    with pytest.raises(CheckpointError, match=r"cannot write the model folder .*/midtrain/model: .*No space left"):
        train(config)
    run_dir = Path(config.run.run_dir)
    assert not (run_dir / "model").exists() and not list(run_dir.glob(".model*"))  # nothing half-written
    assert [p.name for p in list_checkpoints(run_dir / "checkpoints")] == ["step_00000004"]
    monkeypatch.undo()
    assert train(config)["model_dir"] == str(run_dir / "model")  # the same command exports it


def test_resuming_on_another_corpus_build_says_so(make_config, caplog):
    # a tokenizer of its own (a folder, as a Qwen3 checkpoint's): the corpus can change under it
    tokenizer = train(make_config("run.name=tokenizer", "run.steps=3"))["model_dir"]
    fixed = ("run.name=fixed", f"data.tokenizer={tokenizer}")
    first = train(make_config(*fixed, "run.steps=4"), stop_at_step=2)
    build = read_state(Path(first["run_dir"]) / "checkpoints" / "step_00000002")["data"]["corpus_build"]
    caplog.set_level("WARNING", logger="whetstone.midtrain")
    assert train(make_config(*fixed, "run.steps=3"), stop_at_step=3)["resumed_from"].endswith("step_00000002")
    assert not [r for r in caplog.records if "corpus build" in r.getMessage()]  # the same build
    resumed = train(make_config(*fixed, "run.steps=4", "data.split_seed=1"))  # another split: another build
    (said,) = [r.getMessage() for r in caplog.records if "corpus build" in r.getMessage()]
    assert said.startswith(f"checkpoint {resumed['resumed_from']} was trained on the corpus build {build}, and this")
    assert said.endswith("rows go on from number 12 of this build, not in the order the run had")


def test_resuming_with_other_windows_of_the_corpus_says_so(make_config, caplog):
    first = train(make_config("run.steps=4"), stop_at_step=2)
    caplog.set_level("WARNING", logger="whetstone.midtrain")
    resumed = train(make_config("run.steps=4", "data.demo_weight=0.5"))
    (said,) = [r.getMessage() for r in caplog.records if "other windows" in r.getMessage()]
    assert resumed["resumed_from"].endswith("step_00000002") and first["run_dir"] == resumed["run_dir"]
    assert "(data.demo_weight = " in said and "-> 0.5)" in said
