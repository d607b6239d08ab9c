"""Weight versions for online RL: rebuild any stored version, roll back to one, and tell how many
updates apart two versions' weights are.

Rollback republishes an earlier version's weights as a new full version, the newest: servers
follow the store as always (no restart, no special case) and the online loop adopts it at its
next update. Versions are created once (the store's exclusive create), so the history stays what
was actually served, and a rollback racing the loop's publish cannot be lost: whichever takes the
version number first wins, the other is told so. Its manifest names the version whose weights it
holds (`Manifest.republishes`), so a reply's staleness is measured by the weights it was sampled
with (`Lineage`), not by version numbers.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from whetstone.errors import WhetstoneError
from whetstone.store.base import MissingObjectError
from whetstone.sync import Manifest, Publisher, Subscriber, SyncConfig, WeightStore
from whetstone.sync.weight_store import Head

log = logging.getLogger("whetstone.online")


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
        if version < 0:
            raise WhetstoneError(f"there is no version {version}: versions are numbered from 0")
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
    weights = load_version(store, config, version)
    source = store.manifest(version).republishes
    return Publisher(store, as_published).publish(weights, full=True, republishes=version if source is None else source)


class Lineage:
    """How many updates apart the weights of two versions of a store are.

    Each version holds either weights of its own, trained from the version before it (the loop
    and the RL trainer publish version n as an update of version n - 1), or the weights of an
    earlier version, published again by a rollback (its manifest's `republishes`). Versions are
    then nodes of a tree whose edges are updates, and two versions' distance is the number of
    updates on the path between their weights: after v0 -> v1 -> v2 -> v3 and a rollback to v1
    (v4), replies from v1 are 0 updates from v4, from v2 one, and from the rolled-back v3 two,
    where version numbers would say 3, 2 and 1.

    A version whose manifest is gone before it was read (collected, withdrawn; after a restart,
    one read before) may have been a rollback: whose weights it holds is unknown, and taking them
    for its own could put weights many updates away right behind the deployed ones. Its place in
    the tree is unknown, so a reply sampled with it, or with weights reached only through it, is
    counted beyond any bound (dropped as stale): its data is old enough to be collected, as a rule
    far past the bound. What a loop knew before a restart comes back from its state.json
    (`state`, `restore`), so a version read then counts as read."""

    def __init__(self, store: WeightStore):
        self.store = store
        self.known: dict[int, int | None] = {}
        """Version -> the version whose weights it holds (itself unless a rollback); None: unknown,
        its manifest was gone when first asked for."""
        self.newest_read = -1
        """The newest version whose manifest was read: a missing one below it is gone for good."""
        self.saved: dict[int, int] = {}
        """Version -> the version whose weights it holds, as read before a restart (`restore`):
        taken for a version whose manifest is gone; the store's manifest otherwise."""

    def note(self, manifest: Manifest) -> None:
        """Remember whose weights a version holds while its manifest is at hand (it may be
        collected before replies sampled with it are rated)."""
        self.known[manifest.version] = manifest.version if manifest.republishes is None else manifest.republishes
        self.newest_read = max(self.newest_read, manifest.version)

    def weights_of(self, version: int) -> int | None:
        """The version whose weights `version` holds: the version a rollback republished, or
        itself; None if that is unknown (its manifest is gone, or not there yet)."""
        if version not in self.known:
            try:
                source = self.store.manifest(version).republishes
            except MissingObjectError:
                if version in self.saved:  # read before a restart
                    self.known[version] = self.saved[version]
                    return self.known[version]
                if version > self.newest_read:  # perhaps not published yet: ask again next time
                    return None
                if None not in self.known.values():  # said for the first such version: the others go alike
                    log.warning(
                        "version %d's manifest is gone from the weight store %s (garbage-collected, see "
                        "sync.keep_keyframes) before the loop read it: whose weights it holds (a rollback's "
                        "are an earlier version's) is unknown, so replies sampled with it, or with weights "
                        "before it, count as beyond the staleness bound",
                        version,
                        self.store.objects,
                    )
                self.known[version] = None
                return None
            self.newest_read = max(self.newest_read, version)
            self.known[version] = version if source is None else source
        return self.known[version]

    def behind(self, deployed: int, versions: list[int], limit: int) -> int:
        """Updates between the weights of `deployed` and the farthest of `versions` (a reply's
        token versions; 0 if none), counted up to `limit`: `limit + 1` means farther, or unknown
        (a version on the way whose manifest is gone)."""
        if not versions:
            return 0
        ancestors = self._ancestors(deployed, limit)
        farthest = 0
        for version in set(versions):
            node = self.weights_of(version)
            for steps in range(limit + 1):
                if node is None:
                    return limit + 1
                if node in ancestors:
                    farthest = max(farthest, steps + ancestors[node])
                    break
                if node <= 0:
                    return limit + 1
                node = self.weights_of(node - 1)
            else:
                return limit + 1
            if farthest > limit:
                return limit + 1
        return farthest

    def _ancestors(self, deployed: int, limit: int) -> dict[int, int]:
        """The weights up to `limit` updates before `deployed`'s (as far as they are known): the
        version holding them -> updates from the deployed weights."""
        ancestors, node = {}, self.weights_of(deployed)
        for steps in range(limit + 1):
            if node is None:
                break
            ancestors[node] = steps
            if node <= 0:
                break
            node = self.weights_of(node - 1)
        return ancestors

    def state(self, deployed: int, limit: int) -> dict[str, Any]:
        """What a restarted loop could not read again (manifests are collected), for its
        state.json (`restore`): `newest_read`, and whose weights each version known holds (a
        rollback's: an earlier version's), from the oldest version that can still matter on.

        That is the oldest of the weights within `limit` updates (the staleness bound) of the
        `deployed` version's. A reply counted within the bound goes from the weights it was
        sampled with to one of those, each step to an older version, and the deployed weights'
        own walk stops at the oldest: neither asks about a version below it. An older entry
        matters only once the loop adopts weights older than that (a rollback to a version
        still stored), and then only for replies sampled with versions collected meanwhile: it
        is dropped, so the state stays bounded, and those replies count as beyond the bound, as
        for any version whose manifest the loop never read. A weight store that fails to answer
        meanwhile does not fail the save (the update is done): every version known is kept."""
        try:
            oldest = min(self._ancestors(deployed, limit), default=deployed)
        except Exception as err:  # S3 or a file system down for a moment: the next save prunes
            log.warning("the weight store did not answer (%s): state.json keeps every version's lineage known", err)
            oldest = -1
        known = self.saved | {version: source for version, source in self.known.items() if source is not None}
        weights = {str(version): known[version] for version in sorted(known) if version >= oldest}
        return {"newest_read": self.newest_read, "weights": weights}

    def restore(self, saved: dict[str, Any]) -> None:
        """Take back what `state` saved before a restart."""
        self.newest_read = max(self.newest_read, int(saved.get("newest_read", -1)))
        self.saved |= {int(version): int(source) for version, source in saved.get("weights", {}).items()}
