"""Object store in an S3-compatible bucket (AWS, MinIO, R2, moto), via boto3.

Credentials come from boto3's usual chain (environment, config files, instance roles). A PUT is
atomic in S3: readers see the whole old object or the whole new one. `put_if_absent` is S3's
conditional write (`If-None-Match: *`, AWS since 2024; MinIO, R2 and moto support it too).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

from whetstone.errors import WhetstoneError
from whetstone.store.base import MissingObjectError, ObjectExistsError, ObjectStore, check_key

CONFLICT_RETRIES = 5
"""Tries of a conditional write that S3 answers 409 (another one of the key in flight)."""
READ_RETRIES = 5
"""Tries of a GET whose body breaks off while it is read (a dropped connection, a read timeout):
boto3 retries requests, but not the reading of a response's body."""


class S3Store(ObjectStore):
    def __init__(self, bucket: str, prefix: str = "", endpoint_url: str | None = None, region: str | None = None):
        import boto3
        from botocore.config import Config as BotoConfig

        self.bucket = bucket
        self.prefix = prefix.strip("/") + "/" if prefix.strip("/") else ""
        self.endpoint_url = endpoint_url
        config = BotoConfig(retries={"max_attempts": 5, "mode": "standard"}, max_pool_connections=16)
        self._client = boto3.client("s3", endpoint_url=endpoint_url, region_name=region, config=config)

    def __repr__(self) -> str:
        return f"S3Store('s3://{self.bucket}/{self.prefix}', endpoint_url={self.endpoint_url!r})"

    def _key(self, key: str) -> str:
        return self.prefix + check_key(key)

    @contextlib.contextmanager
    def _bucket_named(self) -> Iterator[None]:
        """A missing bucket (a mistyped name) as an error that names it, not botocore's."""
        from botocore.exceptions import ClientError

        try:
            yield
        except ClientError as err:
            if err.response.get("Error", {}).get("Code") == "NoSuchBucket":
                raise WhetstoneError(f"bucket {self.bucket!r} does not exist at {self.endpoint_url or 'AWS'}") from None
            raise

    def put(self, key: str, data: bytes) -> None:
        with self._bucket_named():
            self._client.put_object(Bucket=self.bucket, Key=self._key(key), Body=data)

    def put_if_absent(self, key: str, data: bytes) -> None:
        from botocore.exceptions import ClientError

        for attempt in range(CONFLICT_RETRIES):
            try:
                with self._bucket_named():
                    self._client.put_object(Bucket=self.bucket, Key=self._key(key), Body=data, IfNoneMatch="*")
                return
            except ClientError as err:
                code = err.response.get("Error", {}).get("Code")
                # 409: another conditional write of the key is in flight (maybe our own first
                # attempt, which boto3 timed out and retried): once it settles, 412 or success
                if code == "ConditionalRequestConflict" and attempt < CONFLICT_RETRIES - 1:
                    time.sleep(0.2 * 2**attempt)
                    continue
                if code == "NotImplemented":  # 501: an S3-compatible store without conditional writes
                    raise WhetstoneError(
                        f"cannot create {key!r} in s3://{self.bucket}/{self.prefix} exclusively: the store at "
                        f"{self.endpoint_url or 'AWS'} does not implement conditional writes (If-None-Match: *), "
                        "which keep two writers from creating one key; use a store that does (AWS S3, MinIO, R2) "
                        "or a directory"
                    ) from None
                if code not in ("PreconditionFailed", "ConditionalRequestConflict"):  # 412: the key exists
                    raise
                with contextlib.suppress(MissingObjectError):  # (a 409 whose other write failed)
                    if self.get(key) == data:
                        return  # our own first attempt landed and its response was lost: boto3 retried it
                raise ObjectExistsError(f"object {key!r} already exists in s3://{self.bucket}/{self.prefix}") from None

    def get(self, key: str) -> bytes:
        """The object's bytes; one whose body breaks off while read is fetched again
        (`READ_RETRIES` tries, then a ConnectionError naming it: an outage, not a missing object)."""
        from botocore.exceptions import ClientError, IncompleteReadError, ReadTimeoutError, ResponseStreamingError

        for attempt in range(READ_RETRIES):
            if attempt:
                time.sleep(0.1 * 2 ** (attempt - 1))
            try:
                with self._bucket_named():
                    body = self._client.get_object(Bucket=self.bucket, Key=self._key(key))["Body"]
            except ClientError as err:
                if err.response.get("Error", {}).get("Code") in ("NoSuchKey", "404"):
                    raise MissingObjectError(f"no object {key!r} in s3://{self.bucket}/{self.prefix}") from None
                raise
            try:
                return body.read()
            except (IncompleteReadError, ReadTimeoutError, ResponseStreamingError) as err:
                body.close()
                broken = err
        raise ConnectionError(
            f"reading {key!r} from s3://{self.bucket}/{self.prefix} at {self.endpoint_url or 'AWS'} broke off "
            f"{READ_RETRIES} times (the network or the store is failing; try again later): {broken}"
        ) from broken

    def list(self, prefix: str = "") -> list[str]:
        paginator = self._client.get_paginator("list_objects_v2")
        keys = []
        with self._bucket_named():
            for page in paginator.paginate(Bucket=self.bucket, Prefix=self.prefix + prefix):
                keys.extend(item["Key"][len(self.prefix) :] for item in page.get("Contents", []))
        return sorted(keys)

    def delete(self, key: str) -> None:
        with self._bucket_named():
            self._client.delete_object(Bucket=self.bucket, Key=self._key(key))

    def exists(self, key: str) -> bool:
        from botocore.exceptions import ClientError

        try:
            self._client.head_object(Bucket=self.bucket, Key=self._key(key))
            return True
        except ClientError as err:
            if err.response.get("Error", {}).get("Code") in ("404", "NoSuchKey", "NotFound"):
                return False
            raise

    def create_bucket(self) -> None:
        """Create the bucket if it does not exist (for tests and first-time setup)."""
        from botocore.exceptions import ClientError

        try:
            self._client.create_bucket(Bucket=self.bucket)
        except ClientError as err:
            if err.response.get("Error", {}).get("Code") not in ("BucketAlreadyOwnedByYou", "BucketAlreadyExists"):
                raise
