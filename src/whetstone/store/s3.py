"""Object store in an S3-compatible bucket (AWS, MinIO, R2, moto), via boto3.

Credentials come from boto3's usual chain (environment, config files, instance roles). A PUT is
atomic in S3: readers see the whole old object or the whole new one. `put_if_absent` is S3's
conditional write (`If-None-Match: *`, AWS since 2024; MinIO, R2 and moto support it too).
A missing bucket is a `WhetstoneError` naming it; a request refused for lack of permission an
`AccessDeniedError` naming the bucket, the key and what to check.
"""

from __future__ import annotations

import contextlib
import re
import time
from collections.abc import Iterator

from whetstone.errors import AccessDeniedError, WhetstoneError
from whetstone.store.base import MissingObjectError, ObjectExistsError, ObjectStore, check_key, check_prefix

CONFLICT_RETRIES = 5
"""Tries of a conditional write that S3 answers 409 (another one of the key in flight)."""
CONFLICT_BACKOFF_S = 0.2
"""Wait before the second try of a conditional write answered 409, doubling at each further try."""
READ_RETRIES = 5
"""Tries of a GET whose body breaks off while it is read (a dropped connection, a read timeout):
boto3 retries requests, but not the reading of a response's body."""
DENIED_CODES = frozenset({"AccessDenied", "AllAccessDisabled", "ExpiredToken", "InvalidToken", "TokenRefreshRequired"})
"""Error codes of requests refused for lack of permission; any 403 is one too, but
`NOT_DENIED_403`."""
NOT_DENIED_403 = frozenset({"InvalidObjectState", "RequestTimeTooSkewed"})
"""403s about the object's state (archived) or the client's clock, not about permission."""
ACTIONS = {
    "GetObject": "s3:GetObject",
    "HeadObject": "s3:GetObject",
    "PutObject": "s3:PutObject",
    "DeleteObject": "s3:DeleteObject",
    "ListObjectsV2": "s3:ListBucket",
    "HeadBucket": "s3:ListBucket",
    "CreateBucket": "s3:CreateBucket",
}
"""The IAM action each request the store makes needs."""


BUCKET_NAME = re.compile(r"[A-Za-z0-9._-]{1,255}\Z")
"""A bucket's name as botocore takes it (AWS's own rules are narrower; other S3 services differ)."""


class S3Store(ObjectStore):
    def __init__(self, bucket: str, prefix: str = "", endpoint_url: str | None = None, region: str | None = None):
        import boto3
        from botocore.config import Config as BotoConfig

        if not BUCKET_NAME.match(bucket) and not bucket.startswith("arn:"):  # what botocore refuses at each request
            raise WhetstoneError(
                f"invalid bucket name {bucket!r} in s3://{bucket}/{prefix}: a bucket is named by letters, digits, "
                "'.', '-' and '_' (or an access point's ARN); write the store as s3://bucket/prefix"
            )
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
    def _errors_named(self, key: str | None) -> Iterator[None]:
        """botocore's errors that are about the store's setup, not about the object, as errors that
        name the bucket: a missing bucket (a mistyped name) and a refused request
        (`AccessDeniedError`: `key`, the key in the bucket or the prefix listed, None for the bucket
        itself, and what to check)."""
        from botocore.exceptions import ClientError, NoCredentialsError

        try:
            yield
        except NoCredentialsError:
            raise AccessDeniedError(
                f"no AWS credentials found for s3://{self.bucket}/{key or ''} at {self.endpoint_url or 'AWS'}: set "
                "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY or AWS_PROFILE, or run where an instance or pod role "
                "provides them",
                self.bucket,
                key,
            ) from None
        except ClientError as err:
            code = err.response.get("Error", {}).get("Code")
            if code == "NoSuchBucket":
                raise self._missing_bucket() from None
            if _denied(err):
                raise self._access_denied(key, err) from None
            raise

    def _missing_bucket(self) -> WhetstoneError:
        return WhetstoneError(f"bucket {self.bucket!r} does not exist at {self.endpoint_url or 'AWS'}")

    def _access_denied(self, key: str | None, err) -> AccessDeniedError:
        error = err.response.get("Error", {})
        operation = err.operation_name
        action = ACTIONS.get(operation, f"s3:{operation}")
        where = f"s3://{self.bucket}/{key}" if key is not None else f"bucket {self.bucket!r}"
        missing = (
            " (S3 also answers a read of a missing key with 403 where s3:ListBucket is not allowed)"
            if operation in ("GetObject", "HeadObject")
            else ""
        )
        return AccessDeniedError(
            f"access denied: {operation} of {where} at {self.endpoint_url or 'AWS'} was refused "
            f"({error.get('Code')}: {error.get('Message')}){missing}; check the credentials boto3 uses "
            f"(AWS_ACCESS_KEY_ID, AWS_PROFILE, an instance or pod role) and that their IAM policy and the "
            f"bucket policy allow {action} on bucket {self.bucket!r}",
            self.bucket,
            key,
        )

    def put(self, key: str, data: bytes) -> None:
        with self._errors_named(self._key(key)):
            self._client.put_object(Bucket=self.bucket, Key=self._key(key), Body=data)

    def put_if_absent(self, key: str, data: bytes) -> None:
        """`ObjectStore.put_if_absent`. A 409 (another conditional write of the key in flight) is
        tried again `CONFLICT_RETRIES` times; one that lasts is a ConnectionError naming the key
        where the key holds nothing (no object exists to report)."""
        from botocore.exceptions import ClientError

        for attempt in range(CONFLICT_RETRIES):
            try:
                with self._errors_named(self._key(key)):
                    self._client.put_object(Bucket=self.bucket, Key=self._key(key), Body=data, IfNoneMatch="*")
                return
            except ClientError as err:
                code = err.response.get("Error", {}).get("Code")
                # 409: another conditional write of the key is in flight (maybe our own first
                # attempt, which boto3 timed out and retried): once it settles, 412 or success
                if code == "ConditionalRequestConflict" and attempt < CONFLICT_RETRIES - 1:
                    time.sleep(CONFLICT_BACKOFF_S * 2**attempt)
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
                try:
                    if self.get(key) == data:
                        return  # our own first attempt landed and its response was lost: boto3 retried it
                except MissingObjectError:
                    if code == "ConditionalRequestConflict":  # every try met another write in flight
                        raise ConnectionError(
                            f"cannot create {key!r} in s3://{self.bucket}/{self.prefix}: the store at "
                            f"{self.endpoint_url or 'AWS'} answered all {CONFLICT_RETRIES} tries 409 "
                            "ConditionalRequestConflict (other writes of the key in flight) and the key holds "
                            "nothing; it was not created, try again"
                        ) from None
                raise ObjectExistsError(f"object {key!r} already exists in s3://{self.bucket}/{self.prefix}") from None

    def get(self, key: str) -> bytes:
        """The object's bytes; one whose body breaks off while read is fetched again
        (`READ_RETRIES` tries, then a ConnectionError naming it: an outage, not a missing object)."""
        from botocore.exceptions import ClientError, IncompleteReadError, ReadTimeoutError, ResponseStreamingError

        for attempt in range(READ_RETRIES):
            if attempt:
                time.sleep(0.1 * 2 ** (attempt - 1))
            try:
                with self._errors_named(self._key(key)):
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
        """`ObjectStore.list`, less the folder markers S3 consoles make (an empty object named like
        a folder: `weights/`), which no key names (`check_key`)."""
        check_prefix(prefix)
        paginator = self._client.get_paginator("list_objects_v2")
        keys = []
        with self._errors_named(self.prefix + prefix):
            for page in paginator.paginate(Bucket=self.bucket, Prefix=self.prefix + prefix):
                keys.extend(
                    item["Key"][len(self.prefix) :]
                    for item in page.get("Contents", [])
                    if not item["Key"].endswith("/")
                )
        return sorted(keys)

    def delete(self, key: str) -> None:
        with self._errors_named(self._key(key)):
            self._client.delete_object(Bucket=self.bucket, Key=self._key(key))

    def exists(self, key: str) -> bool:
        """Whether the object is there. A HEAD's 404 does not tell a missing key from a missing
        bucket: the bucket is asked about then, and a missing one is an error naming it (a mistyped
        name is no answer about the key)."""
        from botocore.exceptions import ClientError

        try:
            with self._errors_named(self._key(key)):
                self._client.head_object(Bucket=self.bucket, Key=self._key(key))
            return True
        except ClientError as err:
            if err.response.get("Error", {}).get("Code") not in ("404", "NoSuchKey", "NotFound"):
                raise
        try:
            with self._errors_named(None):
                self._client.head_bucket(Bucket=self.bucket)
        except ClientError as err:
            if err.response.get("Error", {}).get("Code") in ("404", "NoSuchBucket", "NotFound"):
                raise self._missing_bucket() from None
            raise
        return False

    def create_bucket(self) -> None:
        """Create the bucket if it does not exist (for tests and first-time setup)."""
        from botocore.exceptions import ClientError

        try:
            with self._errors_named(None):
                self._client.create_bucket(Bucket=self.bucket)
        except ClientError as err:
            if err.response.get("Error", {}).get("Code") not in ("BucketAlreadyOwnedByYou", "BucketAlreadyExists"):
                raise


def _denied(err) -> bool:
    """Whether a botocore `ClientError` is a request refused for lack of permission."""
    code = err.response.get("Error", {}).get("Code")
    status = err.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    return code in DENIED_CODES or (status == 403 and code not in NOT_DENIED_403)
