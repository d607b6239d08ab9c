"""Training checkpoints: everything a run needs to continue bit for bit, written atomically.

Layout of `<run>/checkpoints/step_<NNNNNNNN>/` (the directory appears whole or not at all):

    model.safetensors      fp32 master weights (tied tensors stored once)
    optimizer.safetensors  AdamW moments and step counts, keyed `<param name>.<state key>`
    state.json             step, tokens, data-loader position, RNG states, optimizer hyper-
                           parameters, the run's config, and a sha256 of each tensor file

The learning-rate schedule is a pure function of the step, so the step is its whole state. A
resumed optimizer takes only the moments and step counts from the checkpoint; its hyperparameters
(weight decay, betas, eps) are those it was built with, the current config's: the ones in
state.json record what the run was trained with.

A checkpoint that cannot be resumed is refused with a `CheckpointError` naming the file or tensor
before anything of the run is modified; one whose files are missing, unreadable or corrupt raises
its subclass `DamagedCheckpoint` (`naming_older_checkpoints` then names the older complete ones).
`state.data` also records the identity of the tokenizer the run trains with (`TOKENIZER_KEY`,
`check_tokenizer`): the weights only make sense with the token ids they were trained on.
"""

from __future__ import annotations

import base64
import hashlib
import json
import random
import re
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file, save_model

from whetstone.errors import CheckpointError, ConfigError
from whetstone.utils.atomic import atomic_directory

FORMAT_VERSION = 1

IMPLEMENTATION_KEYS = ("fused", "foreach", "capturable", "differentiable")
"""AdamW group settings that choose how a step is computed, not what it computes: kept from the
optimizer a checkpoint loads into, not taken from the checkpoint."""


def implementation(group: dict) -> dict:
    """An optimizer group's `IMPLEMENTATION_KEYS` settings (a CUDA optimizer's fused AdamW, say)."""
    return {key: group[key] for key in IMPLEMENTATION_KEYS if key in group}


MODEL_FILE, OPTIMIZER_FILE, STATE_FILE = "model.safetensors", "optimizer.safetensors", "state.json"
_STEP_DIR = re.compile(r"^step_(\d+)$")
_TEMPORARY_DIR = re.compile(r"^\.step_\d+\..+\.tmp$")
"""What `atomic_directory` writes a checkpoint into before renaming it to `step_<N>`."""

TOKENIZER_KEY = "tokenizer_sha256"
"""`state.data` key: the sha256 of the run's tokenizer.json (`tokenizer_identity`)."""


class DamagedCheckpoint(CheckpointError):
    """A checkpoint whose files are missing, unreadable or corrupt (not one that does not fit
    the config: an older checkpoint of the run would not fit either)."""


@dataclass
class TrainState:
    """The loop's own counters and the data loader's position."""

    step: int = 0
    tokens: int = 0
    data: dict[str, Any] = field(default_factory=dict)


def checkpoint_dir(root: Path, step: int) -> Path:
    return root / f"step_{step:08d}"


def list_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoints under `root`, oldest first (temporary `.step_*` dirs are skipped)."""
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if _STEP_DIR.match(p.name) and p.is_dir()]
    return sorted(found, key=checkpoint_step)


def checkpoint_step(path: Path) -> int:
    """The step a checkpoint folder (`step_<N>`) holds."""
    match = _STEP_DIR.match(path.name)
    if match is None:
        raise ValueError(f"{path} is not a checkpoint folder (step_<N>)")
    return int(match.group(1))


def latest_checkpoint(root: Path) -> Path | None:
    found = list_checkpoints(root)
    return found[-1] if found else None


def remove_stale_temporaries(root: Path) -> list[Path]:
    """Delete the temporary `.step_*.tmp` folders under `root` that saves which crashed left
    (each as big as a checkpoint); return them. Call it only where no save is in progress: when
    the run that owns `root` starts (only its own process writes there)."""
    if not root.is_dir():
        return []
    stale = sorted(p for p in root.iterdir() if _TEMPORARY_DIR.match(p.name) and p.is_dir() and not p.is_symlink())
    for folder in stale:
        shutil.rmtree(folder, ignore_errors=True)
    return stale


def verify_checkpoint(path: Path) -> dict[str, Any]:
    """`read_state(path)`, after checking both tensor files against their sha256 (without
    loading them); raises `DamagedCheckpoint` naming the first bad file."""
    record = read_state(path)
    for name, digest in record["sha256"].items():
        if _sha256(path / name) != digest:
            raise DamagedCheckpoint(f"checkpoint file {path / name} is corrupt (sha256 mismatch)")
    return record


@contextmanager
def naming_older_checkpoints(newest: Path) -> Iterator[None]:
    """Around resuming `newest`, the newest checkpoint of its folder: a `DamagedCheckpoint` is
    raised again with the older complete checkpoints named, and how to resume from them.

    The run does not fall back to one by itself: the steps after it would be lost unnoticed.
    """
    try:
        yield
    except DamagedCheckpoint as err:
        root = newest.parent
        older = []
        for path in reversed([p for p in list_checkpoints(root) if checkpoint_step(p) < checkpoint_step(newest)]):
            try:
                verify_checkpoint(path)
            except CheckpointError:
                continue
            older.append(path)
        if older:
            names = ", ".join(p.name for p in older)
            advice = (
                f"Older complete checkpoints in {root}: {names}. The run does not fall back by itself "
                f"(the steps after {older[0].name} would be trained again unnoticed): move {newest} out of "
                f"{root} to resume from {older[0].name}"
            )
        else:
            advice = f"There is no older complete checkpoint in {root}: move {newest} out of it to start afresh"
        raise DamagedCheckpoint(f"{err}. {newest.name} is the run's newest checkpoint. {advice}") from None


def tokenizer_identity(folder: Path) -> str | None:
    """The sha256 of `folder/tokenizer.json` (what maps text to token ids), None without one."""
    file = folder / "tokenizer.json"
    if not file.is_file():
        return None
    try:
        return hashlib.sha256(file.read_bytes()).hexdigest()
    except OSError as err:
        raise CheckpointError(f"{file} cannot be read: {err.strerror}") from None


def check_tokenizer(checkpoint: Path, data: dict[str, Any], current: str | None, source: str, advice: str) -> None:
    """Refuse to resume `checkpoint` (its `state.data` is `data`) with a tokenizer other than
    the one it was trained with: `current` is this run's `tokenizer_identity`, `source` says where
    it comes from, `advice` what to do. Where either is unknown (a checkpoint without the record,
    a model folder without tokenizer.json) there is nothing to compare."""
    recorded = data.get(TOKENIZER_KEY)
    if recorded is None or current is None or recorded == current:
        return
    raise ConfigError(
        f"checkpoint {checkpoint} was trained with another tokenizer (tokenizer.json sha256 {str(recorded)[:16]}) "
        f"than this run's {source} (tokenizer.json sha256 {current[:16]}): its weights would go on training on "
        f"other token ids. {advice}"
    )


def save_checkpoint(
    root: Path,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    state: TrainState,
    config: dict[str, Any],
    keep: int,
) -> Path:
    """Write `root/step_<step>` atomically, then drop all but the newest `keep` (>= 1) checkpoints."""
    path = checkpoint_dir(root, state.step)
    try:
        with atomic_directory(path) as tmp:
            save_model(model, str(tmp / MODEL_FILE))
            tensors, groups = _optimizer_tensors(model, optimizer)
            save_file(tensors, str(tmp / OPTIMIZER_FILE))
            record = {
                "format_version": FORMAT_VERSION,
                "step": state.step,
                "tokens": state.tokens,
                "data": state.data,
                "rng": _rng_state(),
                "optimizer_param_groups": groups,
                "config": config,
                "sha256": {name: _sha256(tmp / name) for name in (MODEL_FILE, OPTIMIZER_FILE)},
            }
            (tmp / STATE_FILE).write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
    except (OSError, SafetensorError) as err:  # a full disk, a folder made read-only meanwhile
        previous = latest_checkpoint(root)  # untouched: a checkpoint is replaced only once the new one is whole
        kept = (
            f"the newest checkpoint, {previous}, is intact and the same command resumes from it"
            if previous is not None
            else "there is no earlier checkpoint"
        )
        raise CheckpointError(
            f"cannot write checkpoint {path} in {root}: {err}. Nothing of it was kept; {kept}"
        ) from None
    for old in list_checkpoints(root)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return path


def load_checkpoint(path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> TrainState:
    """Restore model, optimizer and RNG states from `path` in place; return the loop's state.

    Every check runs before anything is modified, so a bad checkpoint leaves the run untouched.
    """
    record = verify_checkpoint(path)
    weights = _load_tensors(path / MODEL_FILE)
    _check_model_tensors(path / MODEL_FILE, model, weights)
    moments = _load_tensors(path / OPTIMIZER_FILE)
    optimizer_state = _optimizer_state_dict(path / OPTIMIZER_FILE, model, optimizer, moments, record)
    rng = _decode_rng(path / STATE_FILE, record["rng"])

    model.load_state_dict(weights, strict=False)  # tied aliases are absent from the file; checked above
    optimizer.load_state_dict(optimizer_state)
    torch.set_rng_state(rng["torch"])
    random.setstate(rng["python"])
    np.random.set_state(rng["numpy"])
    return TrainState(step=record["step"], tokens=record["tokens"], data=record["data"])


def load_weights(path: Path, model: torch.nn.Module) -> dict[str, Any]:
    """Only the model weights of checkpoint `path`, into `model` in place (checked as
    `load_checkpoint` checks them: digest, names, shapes, dtypes); returns the checkpoint's `state.json`.
    For exporting a checkpoint's policy without its optimizer."""
    record = read_state(path)
    if _sha256(path / MODEL_FILE) != record["sha256"][MODEL_FILE]:
        raise DamagedCheckpoint(f"checkpoint file {path / MODEL_FILE} is corrupt (sha256 mismatch)")
    weights = _load_tensors(path / MODEL_FILE)
    _check_model_tensors(path / MODEL_FILE, model, weights)
    model.load_state_dict(weights, strict=False)  # tied aliases are absent from the file; checked above
    return record


def read_state(path: Path) -> dict[str, Any]:
    """The parsed `state.json` of a checkpoint, its fields checked for type, or a
    `CheckpointError` naming what is wrong (`DamagedCheckpoint` for a missing or bad file)."""
    file = path / STATE_FILE
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {path} does not exist")
    try:
        record = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise DamagedCheckpoint(f"checkpoint file {file} is corrupt: {err}") from None
    except OSError as err:
        raise _unreadable(file, err) from None
    if not isinstance(record, dict) or record.get("format_version") != FORMAT_VERSION:
        raise DamagedCheckpoint(f"checkpoint file {file}: unsupported format (expected version {FORMAT_VERSION})")
    missing = {"step", "tokens", "data", "rng", "optimizer_param_groups", "sha256"} - record.keys()
    if missing:
        raise DamagedCheckpoint(f"checkpoint file {file} is corrupt: missing {sorted(missing)}")
    problem = _state_problem(path, record)
    if problem:
        raise DamagedCheckpoint(f"checkpoint file {file} is corrupt: {problem}")
    return record


def _state_problem(path: Path, record: dict[str, Any]) -> str | None:
    """What is wrong with the types of a parsed state.json's fields, or None."""

    def count(value) -> bool:
        return isinstance(value, int) and not isinstance(value, bool) and value >= 0

    for key in ("step", "tokens"):
        if not count(record[key]):
            return f"{key!r} is {record[key]!r}, not a count (an integer >= 0)"
    match = _STEP_DIR.match(path.name)
    if match and int(match.group(1)) != record["step"]:
        return f"'step' is {record['step']}, but the folder is {path.name}"
    data = record["data"]
    if not isinstance(data, dict):
        return f"'data' is {type(data).__name__}, not an object"
    if "next_batch" in data and not count(data["next_batch"]):
        return f"data.next_batch is {data['next_batch']!r}, not a count (an integer >= 0)"
    if not isinstance(record["rng"], dict):
        return f"'rng' is {type(record['rng']).__name__}, not an object"
    groups = record["optimizer_param_groups"]
    if not isinstance(groups, list) or not all(isinstance(group, dict) for group in groups):
        return "'optimizer_param_groups' is not a list of objects"
    digests = record["sha256"]
    files = {MODEL_FILE, OPTIMIZER_FILE}
    if (
        not isinstance(digests, dict)
        or digests.keys() != files
        or not all(isinstance(d, str) for d in digests.values())
    ):
        return f"'sha256' must map {sorted(files)} to their digests, it is {digests!r}"
    if not isinstance(record.get("config", {}), dict):
        return "'config' is not an object"
    return None


def _unreadable(file: Path, err: OSError) -> CheckpointError:
    """The error for a checkpoint file that `open` refused (`err`)."""
    checkpoint = file.parent
    if isinstance(err, FileNotFoundError):
        if not checkpoint.is_dir():  # pruned by a run saving into this folder while it was read
            return CheckpointError(
                f"checkpoint {checkpoint} was removed while it was read: is a run writing to {checkpoint.parent}?"
            )
        return DamagedCheckpoint(f"checkpoint file {file} is missing")
    if isinstance(err, PermissionError):  # not damaged: the file is there, this user may not read it
        return CheckpointError(f"checkpoint file {file} cannot be read: permission denied (see its owner and mode)")
    return DamagedCheckpoint(f"checkpoint file {file} cannot be read: {err.strerror or err}")


def _load_tensors(file: Path) -> dict[str, torch.Tensor]:
    try:
        return load_file(str(file))
    except OSError as err:
        raise _unreadable(file, err) from None
    except (SafetensorError, ValueError, RuntimeError) as err:
        # safetensors reports a file it cannot open as a RuntimeError ("unable to open file")
        if not file.is_file():
            raise _unreadable(file, FileNotFoundError(str(file))) from None
        raise DamagedCheckpoint(f"checkpoint file {file} is corrupt: {err}") from None


def _check_model_tensors(file: Path, model: torch.nn.Module, weights: dict[str, torch.Tensor]) -> None:
    expected = model.state_dict()
    for name, tensor in weights.items():
        if name not in expected:
            raise CheckpointError(f"{file}: tensor {name!r} is not in the model built from the config")
        if tensor.shape != expected[name].shape:
            raise CheckpointError(
                f"{file}: tensor {name!r} has shape {list(tensor.shape)}, "
                f"the config's model expects {list(expected[name].shape)}"
            )
        if tensor.dtype != expected[name].dtype:  # the master weights (fp32)
            raise DamagedCheckpoint(
                f"{file}: tensor {name!r} is {_dtype(tensor)}, a checkpoint holds the model's "
                f"{_dtype(expected[name])} master weights"
            )
    # Tied weights: the model shares one tensor under two names and the file holds one of them.
    owner: dict[int, str] = {}
    for name in weights:
        first = owner.setdefault(expected[name].data_ptr(), name)
        if first != name:
            raise CheckpointError(
                f"{file}: tensors {first!r} and {name!r} are stored apart, but the config's model ties "
                "them (tie_word_embeddings)"
            )
    stored = set(owner)
    for name, tensor in expected.items():
        if name not in weights and tensor.data_ptr() not in stored:
            raise CheckpointError(f"{file}: tensor {name!r} is missing")


def _param_names(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    """Names of the optimizer's parameters in its own index order."""
    by_id = {id(p): name for name, p in model.named_parameters()}
    return [by_id[id(p)] for group in optimizer.param_groups for p in group["params"]]


def _optimizer_tensors(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, list]:
    state_dict = optimizer.state_dict()
    names = _param_names(model, optimizer)
    tensors = {
        f"{names[index]}.{key}": value.contiguous()
        for index, per_param in state_dict["state"].items()
        for key, value in per_param.items()
    }
    groups = [{k: v for k, v in group.items() if k != "params"} for group in state_dict["param_groups"]]
    return tensors, groups


def _optimizer_state_dict(file: Path, model, optimizer, moments: dict[str, torch.Tensor], record: dict) -> dict:
    """Rebuild an optimizer state dict from `<param name>.<state key>` tensors, checking shapes."""
    index_of = {name: index for index, name in enumerate(_param_names(model, optimizer))}
    params = dict(model.named_parameters())
    state: dict[int, dict[str, torch.Tensor]] = {}
    for stored_name, tensor in moments.items():
        name, _, key = stored_name.rpartition(".")  # parameter names have dots, state keys do not
        if name not in index_of:
            raise CheckpointError(f"{file}: tensor {stored_name!r} does not belong to any model parameter")
        if tensor.dim() > 0 and tensor.shape != params[name].shape:
            raise CheckpointError(
                f"{file}: tensor {stored_name!r} has shape {list(tensor.shape)}, "
                f"the config's model expects {list(params[name].shape)}"
            )
        if tensor.dim() > 0 and tensor.dtype != params[name].dtype:  # moments: as their parameter
            raise DamagedCheckpoint(
                f"{file}: tensor {stored_name!r} is {_dtype(tensor)}, "
                f"its parameter's moments are {_dtype(params[name])}"
            )
        if tensor.dim() == 0 and not tensor.is_floating_point():  # AdamW's step count is a float tensor
            raise DamagedCheckpoint(f"{file}: tensor {stored_name!r} is {_dtype(tensor)}, not a floating-point count")
        state.setdefault(index_of[name], {})[key] = tensor
    current = optimizer.state_dict()["param_groups"]
    saved = record["optimizer_param_groups"]
    saved_factors = [group.get("lr_multiplier", 1.0) for group in saved]
    factors = [group.get("lr_multiplier", 1.0) for group in current]
    if saved_factors != factors:  # another partition of the parameters: named rather than resumed under
        raise CheckpointError(
            f"{file}: {len(saved)} parameter groups with learning-rate factors {saved_factors}, the "
            f"optimizer has {len(current)} with {factors} (optimizer.lr_multipliers changed?)"
        )
    # The groups stay the optimizer's own: its hyperparameters (weight_decay, betas, eps: the
    # config's, so a changed setting applies to the resumed run) and its implementation (a
    # checkpoint written on the CPU must not turn CUDA's fused AdamW into the for-each one, nor
    # the reverse). The checkpoint gives only the per-parameter state: moments and step counts.
    return {"state": state, "param_groups": current}


def _rng_state() -> dict[str, Any]:
    numpy_state = np.random.get_state()
    return {
        "torch": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode(),
        "python": [random.getstate()[0], list(random.getstate()[1]), random.getstate()[2]],
        "numpy": [numpy_state[0], numpy_state[1].tolist(), *numpy_state[2:]],
    }


def _decode_rng(file: Path, rng: dict[str, Any]) -> dict[str, Any]:
    """The stored RNG states in the form each library's `set_state` takes, each tried on a
    generator of its own first: a state of the wrong size or kind is refused before the run's
    model, optimizer or generators are touched."""
    try:
        torch_state = np.frombuffer(base64.b64decode(rng["torch"], validate=True), dtype=np.uint8).copy()
        version, internal, gauss = rng["python"]
        kind, keys, *rest = rng["numpy"]
        states = {
            "torch": torch.from_numpy(torch_state),
            "python": (version, tuple(internal), gauss),
            "numpy": (kind, np.array(keys, dtype=np.uint32), *rest),
        }
        torch.Generator().set_state(states["torch"])
        random.Random().setstate(states["python"])
        np.random.RandomState().set_state(states["numpy"])
    except (KeyError, IndexError, TypeError, ValueError, RuntimeError, OverflowError) as err:
        raise DamagedCheckpoint(f"checkpoint file {file} is corrupt: bad RNG state ({err!r})") from None
    return states


def _dtype(tensor: torch.Tensor) -> str:
    return str(tensor.dtype).removeprefix("torch.")


def _sha256(file: Path) -> str:
    digest = hashlib.sha256()
    try:
        with open(file, "rb") as handle:
            for block in iter(lambda: handle.read(1 << 20), b""):
                digest.update(block)
    except OSError as err:
        raise _unreadable(file, err) from None
    return digest.hexdigest()
