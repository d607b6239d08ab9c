"""A training batch: samples collated into right-padded tensors, and its lossless file form.

Row b, position t feeds `input_ids[b, t]` and predicts `target_ids[b, t]`. Padding is on the
right, so causal attention never lets a real position see it; padded positions have
`loss_mask` False, `target_ids` -1 (the model returns logprob 0 there), `versions` -1 and
routes 0 (a valid expert id, replayed only at positions nothing reads). A row sampled at a
temperature other than 1 (users' feedback, `online`) carries it in `temperatures`: its behavior
logprobs are of logits / T, and so must the trainer's be.

On disk (and in an object store) a batch is one safetensors blob: the tensors, plus the per-row
and batch metadata as JSON in the safetensors header. One blob means one atomic write or `put`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load as safetensors_load
from safetensors.torch import save as safetensors_save

from whetstone.errors import WhetstoneError
from whetstone.rl.samples import NOT_GENERATED, Sample
from whetstone.utils.atomic import atomic_write_bytes
from whetstone.utils.transfer import tensor_to_device, to_device

BATCH_FORMAT_VERSION = 1
IGNORED_TARGET = -1
TENSOR_FIELDS = ("input_ids", "target_ids", "loss_mask", "behavior_logprobs", "versions", "advantages")
OPTIONAL_FIELDS = ("routes", "temperatures", "rollout_shares")
"""Tensors a batch may lack (None): absent from the blob, and from batches written before them."""


@dataclass
class Batch:
    input_ids: torch.Tensor
    """[B, T] int64 tokens fed to the model."""
    target_ids: torch.Tensor
    """[B, T] int64 token each position predicts; -1 on padding."""
    loss_mask: torch.Tensor
    """[B, T] bool: train on this position."""
    behavior_logprobs: torch.Tensor
    """[B, T] float32 sampler logprob of the target (0 where not generated)."""
    versions: torch.Tensor
    """[B, T] int64 weight version that sampled the target, -1 where none did."""
    advantages: torch.Tensor
    """[B, T] float32 advantage of each position (the sample's advantage on every position)."""
    routes: torch.Tensor | None = None
    """[B, T, moe_layers, top_k] int64 experts to replay, or None (dense model, no capture)."""
    temperatures: torch.Tensor | None = None
    """[B] float32 sampling temperature of each row (> 0), or None: every row at 1."""
    rollout_shares: torch.Tensor | None = None
    """[B] float32 share of its rollout's trained tokens each row holds (`Sample.rollout_share`),
    or None: every row is a whole rollout."""
    rows: list[dict[str, Any]] = field(default_factory=list)
    """Per row: task_id, group_id, reward, advantage, oldest_version, num_positions."""
    meta: dict[str, Any] = field(default_factory=dict)
    """Whatever the producer wants the trainer to log (step, dropped counts, ...); JSON values."""

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    @property
    def num_loss_tokens(self) -> int:
        return int(self.loss_mask.sum())

    def select(self, rows: list[int] | range) -> "Batch":
        """The given rows (a micro-batch, a rank's shard), cut to their longest row's length."""
        rows = list(rows)
        if not rows:
            raise WhetstoneError("cannot select zero rows of a batch")
        length = max(self.rows[r]["num_positions"] for r in rows) if self.rows else self.input_ids.shape[1]
        index = to_device(rows, torch.int64, self.input_ids.device)  # without waiting for the device
        parts = {name: getattr(self, name)[index, :length] for name in TENSOR_FIELDS}
        routes = None if self.routes is None else self.routes[index, :length]
        temperatures = None if self.temperatures is None else self.temperatures[index]
        shares = None if self.rollout_shares is None else self.rollout_shares[index]
        return Batch(
            **parts,
            routes=routes,
            temperatures=temperatures,
            rollout_shares=shares,
            rows=[self.rows[r] for r in rows] if self.rows else [],
            meta=self.meta,
        )

    def to(self, device: torch.device) -> "Batch":
        """The batch with its tensors on `device` (itself when they are there already)."""
        if self.input_ids.device == device:
            return self
        moved = {
            name: None if getattr(self, name) is None else tensor_to_device(getattr(self, name), device)
            for name in (*TENSOR_FIELDS, *OPTIONAL_FIELDS)
        }
        return Batch(**moved, rows=self.rows, meta=self.meta)


def shuffled_parts(batch: Batch, parts: int, seed: int) -> list[Batch]:
    """The rows of `batch` in a seeded random order, cut into `parts` near-equal mini-batches
    (fewer when the batch has fewer rows), so that each mini-batch mixes the batch's groups."""
    order = torch.randperm(len(batch), generator=torch.Generator().manual_seed(seed)).tolist()
    parts = min(parts, len(batch))
    return [batch.select(order[i::parts]) for i in range(parts)]


def collate(
    samples: list[Sample], pad_id: int = 0, meta: dict[str, Any] | None = None, temperatures: list[float] | None = None
) -> Batch:
    """Right-pad samples into one batch (all with routes, or all without). `temperatures`: each
    sample's sampling temperature (default: 1 for every row, as rollouts are sampled)."""
    if not samples:
        raise WhetstoneError("cannot collate an empty list of samples")
    if temperatures is not None and (len(temperatures) != len(samples) or not all(t > 0 for t in temperatures)):
        raise WhetstoneError(
            f"need one temperature > 0 per sample: got {len(temperatures)} for {len(samples)} "
            f"samples, smallest {min(temperatures, default=None)}"
        )
    with_routes = [s.routes is not None for s in samples]
    if any(with_routes) and not all(with_routes):
        raise WhetstoneError(
            f"{with_routes.count(False)} of {len(samples)} samples have no routes: replay needs all or none"
        )
    rows, length = len(samples), max(s.num_positions for s in samples)
    batch = Batch(
        input_ids=torch.full((rows, length), pad_id, dtype=torch.int64),
        target_ids=torch.full((rows, length), IGNORED_TARGET, dtype=torch.int64),
        loss_mask=torch.zeros(rows, length, dtype=torch.bool),
        behavior_logprobs=torch.zeros(rows, length, dtype=torch.float32),
        versions=torch.full((rows, length), NOT_GENERATED, dtype=torch.int64),
        advantages=torch.zeros(rows, length, dtype=torch.float32),
        temperatures=None if temperatures is None else torch.tensor(temperatures, dtype=torch.float32),
        meta=dict(meta or {}),
    )
    if any(s.rollout_share != 1.0 for s in samples):
        batch.rollout_shares = torch.tensor([s.rollout_share for s in samples], dtype=torch.float32)
    if all(with_routes):
        layers_and_k = samples[0].routes.shape[1:]
        if any(s.routes.shape[1:] != layers_and_k for s in samples):
            raise WhetstoneError("samples have routes of different [moe_layers, top_k]: not the same model")
        batch.routes = torch.zeros(rows, length, *layers_and_k, dtype=torch.int64)
    for row, sample in enumerate(samples):
        n = sample.num_positions
        batch.input_ids[row, :n] = torch.tensor(sample.input_ids[:-1], dtype=torch.int64)
        batch.target_ids[row, :n] = torch.tensor(sample.input_ids[1:], dtype=torch.int64)
        batch.loss_mask[row, :n] = torch.tensor(sample.loss_mask, dtype=torch.bool)
        batch.behavior_logprobs[row, :n] = torch.tensor(sample.behavior_logprobs, dtype=torch.float32)
        batch.versions[row, :n] = torch.tensor(sample.versions, dtype=torch.int64)
        batch.advantages[row, :n] = sample.advantage
        if batch.routes is not None:
            batch.routes[row, :n] = sample.routes
        batch.rows.append(
            {
                "task_id": sample.task_id,
                "group_id": sample.group_id,
                "reward": sample.reward,
                "advantage": sample.advantage,
                "oldest_version": sample.oldest_version,
                "num_positions": n,
            }
        )
    return batch


def check_batch(batch: Batch, vocab_size: int, source: str = "batch", row_numbers: list[int] | None = None) -> None:
    """Refuse a batch a model of `vocab_size` tokens cannot train on, naming it (`source`) and
    what is wrong: token ids outside the vocabulary (a batch made with another tokenizer or model:
    the embedding lookup would fail with an index error, on a GPU with a device-side assert that
    ends the process), or a behavior logprob or advantage that is not finite at a trained position
    (one such token makes the whole step's loss NaN). Reads the batch where it is: call it on
    the host copy read from the store, before the step moves it to the device.

    `row_numbers`: each row's number in the batch as stored, when rows were dropped from it
    (`drop_impossible_rows`), so that the rows an error names are those a reader of the stored
    batch finds (default: the rows' own numbers)."""
    trained = batch.loss_mask.bool()
    ranges = [torch.aminmax(ids) for ids in (batch.input_ids, batch.target_ids[trained]) if ids.numel()]
    if ranges:  # each tensor's range where it is: no copy of the whole batch's ids
        low, high = min(int(r.min) for r in ranges), max(int(r.max) for r in ranges)
        if low < 0 or high >= vocab_size:
            raise WhetstoneError(
                f"{source} holds token ids in [{low}, {high}], but the model's vocabulary is 0..{vocab_size - 1}: "
                "the batch was made with another tokenizer or model. Train it with the model its "
                "rollouts were sampled from, or point the batch store at this model's batches"
            )
    for name in ("behavior_logprobs", "advantages"):
        bad = (~torch.isfinite(getattr(batch, name)) & trained).any(dim=1).nonzero().flatten().tolist()
        if bad:
            tasks = sorted({batch.rows[r]["task_id"] for r in bad}) if batch.rows else []
            stored = bad if row_numbers is None else [row_numbers[r] for r in bad]
            raise WhetstoneError(
                f"{source} has {name} that are not finite at trained positions of rows {stored[:10]}"
                f"{' (tasks ' + ', '.join(map(repr, tasks[:10])) + ')' if tasks else ''}: the step's loss would "
                "be NaN. The orchestrator drops rollouts with NaN or infinite logprobs or rewards "
                "(`dropped_nonfinite_logprobs`, `dropped_nonfinite_reward`): delete this batch, and any "
                "after it, from the batch store and restart the orchestrator to make them again"
            )


def drop_impossible_rows(batch: Batch) -> tuple[Batch, list[int]]:
    """`batch` without its rows that have a behavior logprob of -inf at a trained position, and
    those rows' indices. A -inf logprob is a token the sampler gave probability 0 (in its
    precision): the orchestrator drops such rollouts before writing a batch (`nonfinite_logprobs`),
    so only a batch an older orchestrator wrote holds one. Without those rows it trains as the
    orchestrator writes batches, and a trainer replaying it after a restart goes on. The rows are
    dropped alone: a batch does not say which rows are one rollout's. NaN and +inf are no
    logprobs (failed numerics, a damaged batch): `check_batch` refuses them. A batch whose rows
    all have one is returned whole, for `check_batch` to refuse."""
    impossible = (torch.isneginf(batch.behavior_logprobs) & batch.loss_mask.bool()).any(dim=1)
    dropped = impossible.nonzero().flatten().tolist()
    if not dropped or len(dropped) == len(batch):
        return batch, []
    return batch.select(impossible.logical_not().nonzero().flatten().tolist()), dropped


def batch_to_bytes(batch: Batch) -> bytes:
    tensors = {name: getattr(batch, name).contiguous() for name in TENSOR_FIELDS}
    for name in OPTIONAL_FIELDS:
        if getattr(batch, name) is not None:
            tensors[name] = getattr(batch, name).contiguous()
    header = {"format_version": BATCH_FORMAT_VERSION, "rows": batch.rows, "meta": batch.meta}
    return safetensors_save(tensors, metadata={"whetstone_batch": json.dumps(header)})


def batch_from_bytes(data: bytes, source: str = "batch") -> Batch:
    """Inverse of `batch_to_bytes`; `source` names the file or key in errors."""
    try:
        tensors = safetensors_load(data)
        header = _header(data)
    except (SafetensorError, ValueError, KeyError, UnicodeDecodeError) as err:
        raise WhetstoneError(f"{source} is not a whetstone batch: {err}") from None
    if not isinstance(header, dict):
        raise WhetstoneError(f"{source} is not a whetstone batch: its header is not a JSON object")
    if header.get("format_version") != BATCH_FORMAT_VERSION:
        raise WhetstoneError(
            f"{source} has batch format {header.get('format_version')!r}, this build reads {BATCH_FORMAT_VERSION}"
        )
    missing = [name for name in TENSOR_FIELDS if name not in tensors]
    if missing:
        raise WhetstoneError(f"{source} lacks tensors {missing}")
    if not isinstance(header.get("rows"), list) or not isinstance(header.get("meta"), dict):
        raise WhetstoneError(f"{source} is not a whetstone batch: its header lacks the list of rows or the meta object")
    _check_layout(tensors, header["rows"], source)
    optional = {name: tensors.get(name) for name in OPTIONAL_FIELDS}
    return Batch(
        **{name: tensors[name] for name in TENSOR_FIELDS}, **optional, rows=header["rows"], meta=header["meta"]
    )


INTEGER_FIELDS = ("input_ids", "target_ids", "versions", "routes")
FLOAT_FIELDS = ("behavior_logprobs", "advantages", "temperatures", "rollout_shares")
ROW_FIELDS = ("temperatures", "rollout_shares")
"""The optional tensors of one value per row, each finite and > 0."""


def _check_layout(tensors: dict[str, torch.Tensor], rows: list[Any], source: str) -> None:
    """Refuse, naming `source` and the field, a stored batch whose parts do not fit together: the
    per-position tensors of different shapes or dtypes, routes not [B, T, moe_layers, top_k], a
    per-row tensor not [B] or not positive, no rows, or row records that do not describe the rows
    (their count, or a `num_positions` that would cut off trained positions when the trainer trims
    rows to it). Such a batch was not written by `batch_to_bytes` of a collated batch; read as it is,
    the trainer's step would fail on it with an index or shape error, or train on it silently wrong."""
    shape = tuple(tensors["input_ids"].shape)
    if len(shape) != 2 or 0 in shape:
        raise WhetstoneError(
            f"{source} has input_ids of shape {shape}: a batch is [rows, positions], with at least one of each"
        )
    for name in TENSOR_FIELDS:
        if tuple(tensors[name].shape) != shape:
            raise WhetstoneError(
                f"{source} has {name} of shape {tuple(tensors[name].shape)}, but input_ids of shape {shape}"
            )
    for name, tensor in tensors.items():
        if name == "loss_mask" and tensor.dtype != torch.bool:
            raise WhetstoneError(f"{source} has loss_mask of dtype {tensor.dtype}, expected bool")
        if name in INTEGER_FIELDS and (tensor.dtype == torch.bool or tensor.is_floating_point() or tensor.is_complex()):
            raise WhetstoneError(f"{source} has {name} of dtype {tensor.dtype}, expected an integer dtype")
        if name in FLOAT_FIELDS and not tensor.is_floating_point():
            raise WhetstoneError(f"{source} has {name} of dtype {tensor.dtype}, expected a floating-point dtype")
    routes = tensors.get("routes")
    if routes is not None and (routes.dim() != 4 or tuple(routes.shape[:2]) != shape):
        raise WhetstoneError(
            f"{source} has routes of shape {tuple(routes.shape)}, expected ({shape[0]}, {shape[1]}, moe_layers, top_k)"
        )
    for name in ROW_FIELDS:
        values = tensors.get(name)
        if values is None:
            continue
        if tuple(values.shape) != shape[:1]:
            raise WhetstoneError(f"{source} has {name} of shape {tuple(values.shape)}, expected ({shape[0]},)")
        if not (torch.isfinite(values) & (values > 0)).all():
            raise WhetstoneError(f"{source} has {name} {values.tolist()[:10]}: each row's must be finite and > 0")
    if not rows:
        return  # no row records: the trainer takes every row as long as the tensors
    if len(rows) != shape[0]:
        raise WhetstoneError(f"{source} has {len(rows)} row records for {shape[0]} rows")
    for number, row in enumerate(rows):
        if not isinstance(row, dict):
            raise WhetstoneError(f"{source}: row {number}'s record is not an object: {row!r}")
        positions = row.get("num_positions")
        if type(positions) is not int or not 1 <= positions <= shape[1]:
            raise WhetstoneError(
                f"{source}: row {number}'s num_positions is {positions!r}, expected an integer in 1..{shape[1]}"
            )
        oldest = row.get("oldest_version")
        if oldest is not None and type(oldest) is not int:
            raise WhetstoneError(f"{source}: row {number}'s oldest_version is {oldest!r}, expected an integer or null")
    lengths = torch.tensor([row["num_positions"] for row in rows]).view(-1, 1)
    past = (tensors["loss_mask"] & (torch.arange(shape[1]) >= lengths)).any(dim=1).nonzero().flatten().tolist()
    if past:
        number = past[0]
        raise WhetstoneError(
            f"{source}: row {number} trains positions past its num_positions ({rows[number]['num_positions']})"
        )


def _header(data: bytes) -> dict[str, Any]:
    # safetensors layout: 8-byte little-endian header size, then the JSON header.
    size = int.from_bytes(data[:8], "little")
    metadata = json.loads(data[8 : 8 + size]).get("__metadata__") or {}
    return json.loads(metadata["whetstone_batch"])


def save_batch(path: str | Path, batch: Batch) -> None:
    """Write atomically: a reader sees the whole batch or no file."""
    atomic_write_bytes(path, batch_to_bytes(batch))


def load_batch(path: str | Path) -> Batch:
    path = Path(path)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise WhetstoneError(f"batch file {path} does not exist") from None
    return batch_from_bytes(data, source=f"batch file {path}")
