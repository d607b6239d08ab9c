"""Object stores: one small interface, a local-directory backend and an S3 backend.

`open_store("runs/weights")` is a local directory (`~` and `$NAME` expanded, relative to the
working directory); `open_store("s3://bucket/prefix", endpoint_url=...)` is a bucket (the endpoint
selects MinIO, R2, moto... instead of AWS).
"""

from __future__ import annotations

from whetstone.errors import AccessDeniedError
from whetstone.store.base import MissingObjectError, ObjectExistsError, ObjectStore
from whetstone.store.local import LocalStore


def open_store(url: str, endpoint_url: str | None = None, create: bool = True) -> ObjectStore:
    """`create=False`: a local directory that does not exist is an error instead of a new, empty
    store (S3 prefixes need no creating; a missing bucket fails on first access)."""
    if url.startswith("s3://"):
        from whetstone.store.s3 import S3Store

        bucket, _, prefix = url.removeprefix("s3://").partition("/")
        return S3Store(bucket, prefix, endpoint_url=endpoint_url)
    return LocalStore(url.removeprefix("file://"), create=create)


__all__ = ["AccessDeniedError", "LocalStore", "MissingObjectError", "ObjectExistsError", "ObjectStore", "open_store"]
