"""Config of a server's place in the fleet: whether it announces itself, its cluster, its address."""

from __future__ import annotations

from pydantic import Field

from whetstone.config import Config

CLUSTER_PATTERN = r"^[A-Za-z0-9_.-]+$"
"""Cluster labels name metrics and Ray resources, so they are plain words."""


class FleetConfig(Config):
    announce: bool = False
    """Announce this server in the fleet registry of its weight store (`sync.store`) while it
    runs, so that orchestrators which discover servers (`discover_servers`) use it."""
    cluster: str = Field("default", pattern=CLUSTER_PATTERN)
    """Cluster label of this server (a region, a borrowed pool): the orchestrator reports
    rollouts/s and weight version lag per cluster."""
    url: str = ""
    """API root others reach this server at; empty = `http://<host>:<port>/v1`, with this
    machine's address in place of 0.0.0.0."""
    registry: str = ""
    """Store holding the fleet registry (a directory or s3://...; `sync.endpoint_url`); empty =
    the server's weight store. Servers that follow a cluster's mirror (`sync.mirrors`) announce
    in the run's main weight store, where the orchestrator looks."""
    rollout_slots: int = Field(0, ge=0)
    """Most rollouts orchestrators run on this server at once (announced in its record); 0 = no
    limit. A server that also serves users lends this many of its slots (`engine.max_batch`)
    and keeps the rest free for them; its rollouts still yield to users within those slots
    (they are `batch` requests: `engine.batch_beside_interactive`)."""
    heartbeat_s: float = Field(2.0, gt=0)
    """Seconds between rewrites of this server's record; readers forget a server whose record is
    several heartbeats old (`server_heartbeat_timeout_s` of the orchestrator)."""
