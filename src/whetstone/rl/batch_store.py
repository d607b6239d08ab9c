"""The batch store, the orchestrator-trainer contract: batch n is `batches/<n:010d>.batch`, one
`put` of `batch_to_bytes` (a reader sees all of it or nothing). The orchestrator puts batch n, the
trainer's optimizer step n consumes it."""

from __future__ import annotations

from whetstone.errors import WhetstoneError
from whetstone.rl.batch import Batch, batch_from_bytes, batch_to_bytes
from whetstone.store import MissingObjectError, ObjectExistsError, ObjectStore

BATCH_PREFIX = "batches/"


def batch_key(index: int) -> str:
    """The batch store key of batch `index`."""
    return f"{BATCH_PREFIX}{index:010d}.batch"


def batch_indices(store: ObjectStore) -> list[int]:
    """The indices of the batches in the store, in order. Keys of other names are not batches,
    nor is a number written another way (`batches/7.batch`): the trainer reads batch n only at
    `batch_key(n)`, and would wait for ever for a batch counted under another key."""
    keys = set(store.list(BATCH_PREFIX))
    names = (key.removeprefix(BATCH_PREFIX).removesuffix(".batch") for key in keys if key.endswith(".batch"))
    indices = (int(name) for name in names if name.isascii() and name.isdigit())
    return sorted(index for index in indices if batch_key(index) in keys)


def next_batch_index(store: ObjectStore) -> int:
    """One past the newest batch in the store: a restarted orchestrator continues the sequence."""
    return max(batch_indices(store), default=-1) + 1


def put_batch(store: ObjectStore, index: int, batch: Batch) -> None:
    """Create batch `index`, once: a batch the trainer may have read is never replaced (its replay
    after a restart must see the same batch). `WhetstoneError` naming it if it exists already
    (a second orchestrator on this batch store, e.g. one restarted while the old one still ran)."""
    try:
        store.put_if_absent(batch_key(index), batch_to_bytes(batch))
    except ObjectExistsError:
        raise WhetstoneError(
            f"{batch_key(index)} already exists in {store!r}: another orchestrator writes to this batch store"
        ) from None


def get_batch(store: ObjectStore, index: int) -> Batch | None:
    """Batch `index`, or None if it is not in the store yet."""
    key = batch_key(index)
    try:
        return batch_from_bytes(store.get(key), source=f"{key} in {store!r}")
    except MissingObjectError:
        return None
