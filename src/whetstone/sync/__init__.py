"""Weight sync: a lossless delta codec, a versioned weight store, a publisher and subscribers.

    store = WeightStore.open(SyncConfig(store="runs/x/weights"))
    Publisher(store).publish(model.state_dict())          # trainer, every step
    sub = Subscriber(store).start()                        # each inference server
    update = sub.take_update()                             # between decode steps
    if update: apply_update(live_weights, update)

See docs/sync.md.
"""

from whetstone.sync.config import SyncConfig
from whetstone.sync.manifest import Manifest
from whetstone.sync.publisher import Publisher
from whetstone.sync.subscriber import RejectedVersion, Subscriber
from whetstone.sync.update import TensorUpdate, WeightUpdate, apply_update, merge_updates
from whetstone.sync.weight_store import StalePublisherError, VersionExistsError, WeightStore

__all__ = [
    "Manifest",
    "Publisher",
    "RejectedVersion",
    "StalePublisherError",
    "Subscriber",
    "SyncConfig",
    "TensorUpdate",
    "VersionExistsError",
    "WeightStore",
    "WeightUpdate",
    "apply_update",
    "merge_updates",
]
