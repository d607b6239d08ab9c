"""Configuration of weight sync: where versions live, how they are coded, when keyframes come."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from whetstone.config import Config


class SyncConfig(Config):
    store: str = "runs/default/weights"
    """Where weight versions live: a local directory, or s3://bucket/prefix."""
    endpoint_url: str | None = None
    """S3 endpoint for non-AWS object stores (MinIO, R2, moto); None means AWS."""
    publish_dtype: Literal["bfloat16", "float16", "float32", "autocast", "keep"] = "bfloat16"
    """Dtype floating-point tensors are published in (trainer masters stay fp32); `keep` publishes
    as is; `autocast` the dtypes bf16 autocast computes with, which a bf16 engine holds: matmul
    weights in bf16, embedding tables and norms in fp32 (the servers' values unrounded for a bf16
    trainer, at about half the bytes of float32)."""
    keyframe_interval: int = Field(20, ge=1)
    """A full version every this many versions (Fireworks: every 20-30 steps)."""
    chain_budget: float = Field(1.0, gt=0)
    """Also publish a full version once the deltas since the last one add up to this fraction of its size."""
    chunk_elements: int = Field(1 << 24, ge=1, lt=1 << 31)
    """Values per chunk: bounds memory per worker, and the unit of upload, checksum and parallel work."""
    zstd_level: int = Field(1, ge=1, le=22)
    """zstd level of the entropy coding: 1 measured fastest, and no larger than 2 or 3, on RL deltas."""
    workers: int = Field(1, ge=1)
    """Threads encoding/uploading (publisher) or downloading/decoding (subscriber) chunks."""
    keep_keyframes: int = Field(2, ge=1)
    """Garbage collection keeps the newest this many keyframes and every version after the oldest kept."""
    poll_interval: float = Field(0.5, gt=0, allow_inf_nan=False)
    """Seconds between a subscriber's checks for a new version."""
    unavailable_after: float = Field(30.0, ge=0)
    """Seconds a version's objects may stay missing (retried at every poll) before a subscriber reports it stale."""
    mirrors: list[str] = []
    """Further weight stores the publisher copies every version into, after `store` (one per
    inference cluster, e.g. a bucket per region, whose servers follow it); same `endpoint_url`.
    A mirror that cannot be written is caught up at the next publish."""


def check_unrounded_for_invariant(numerics: str, sync: SyncConfig, dtype: str) -> None:
    """Refuse invariant numerics over weights published rounded: the servers compute with what is
    published, and rounded weights are other weights, which no kernel can make agree. (`autocast`
    rounds only what a bf16 trainer's autocast rounds, to the same values.)"""
    rounded = sync.publish_dtype in ("bfloat16", "float16") or (
        sync.publish_dtype == "autocast" and dtype != "bfloat16"
    )
    if numerics == "invariant" and rounded:
        also = " (or 'autocast', with dtype = 'bfloat16')" if dtype != "bfloat16" else " or 'autocast'"
        raise ValueError(
            f"numerics = 'invariant' matches the servers bit for bit only on the weights the trainer computes "
            f"with, but sync.publish_dtype = {sync.publish_dtype!r} rounds them: set sync.publish_dtype = "
            f"'float32'{also}"
        )
