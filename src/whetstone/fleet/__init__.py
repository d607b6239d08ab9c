"""The elastic inference fleet: servers announce themselves in a registry in the weight store,
and orchestrators find them there (`registry.py`)."""

from whetstone.fleet.config import FleetConfig
from whetstone.fleet.registry import Announcer, FleetRegistry, ServerRecord

__all__ = ["Announcer", "FleetConfig", "FleetRegistry", "ServerRecord"]
