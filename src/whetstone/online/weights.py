"""Weight versions for online RL: rebuild any stored version, and roll back to one.

Rollback republishes an earlier version's weights as a new full version, the newest: servers
follow the store as always (no restart, no special case) and the online loop adopts it at its
next update. Versions are created once (the store's exclusive create), so the history stays what
was actually served, and a rollback racing the loop's publish cannot be lost: whichever takes the
version number first wins, the other is told so.
"""

from __future__ import annotations

import torch

from whetstone.errors import WhetstoneError
from whetstone.sync import Manifest, Publisher, Subscriber, SyncConfig, WeightStore
from whetstone.sync.weight_store import Head


class _StoreAsOf(WeightStore):
    """The store as it was when `version` was its newest (a subscriber then stops there)."""

    def __init__(self, store: WeightStore, version: int):
        super().__init__(store.objects)
        self.version = version

    def head(self) -> Head | None:
        return Head(self.version, None)


def load_version(store: WeightStore, config: SyncConfig, version: int) -> dict[str, torch.Tensor]:
    """The weights of `version`, rebuilt from its keyframe and deltas, every chunk verified."""
    stored = store.versions()
    if version not in stored:
        where = f"the weight store {config.store}"
        if not stored:
            raise WhetstoneError(f"version {version} is not in {where}: it holds no versions")
        if version > stored[-1]:
            raise WhetstoneError(f"version {version} is newer than the latest ({stored[-1]}) in {where}")
        why = "; older ones were garbage-collected, see sync.keep_keyframes" if version < stored[0] else ""
        raise WhetstoneError(f"version {version} is not in {where} (stored versions: {stored[0]}..{stored[-1]}{why})")
    subscriber = Subscriber(_StoreAsOf(store, version), config, name=f"load-{version}")
    if subscriber.poll() != version:
        problems = [f"{v}: {why}" for v, why in subscriber.rejected.items()]
        problems += [f"{v}: {missing.reason}" for v, missing in subscriber.unavailable.items()]
        problems = "; ".join(problems) or "a chunk is missing"
        raise WhetstoneError(f"version {version} cannot be rebuilt from the weight store {config.store}: {problems}")
    return subscriber.state


def rollback(config: SyncConfig, version: int) -> Manifest:
    """Publish `version`'s weights again as the newest version (a full one); returns its manifest.
    `VersionExistsError` if another publisher took that version number first: nothing was
    published, run it again."""
    store = WeightStore.open(config, create=False)
    latest = store.latest()
    if latest is None:
        raise WhetstoneError(f"the weight store {config.store} is empty: nothing to roll back")
    if version == latest:
        raise WhetstoneError(f"version {version} is already the newest in the weight store {config.store}")
    # as they were published (`keep`): publishing them anew in publish_dtype could round them again
    # (`autocast` would need the model's embedding tables, which a store does not name)
    as_published = config.model_copy(update={"publish_dtype": "keep"})
    return Publisher(store, as_published).publish(load_version(store, config, version), full=True)
