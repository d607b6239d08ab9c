"""S3 requests that the moto server refuses as AWS would: signed as an IAM user whose policy allows
some actions only, or with credentials it does not know, while moto enforces IAM permissions.

moto checks permissions in the process it runs in (the tests' moto server is a thread of theirs):
inside the block every request to it is checked, so stores made before the block (with the
placeholder credentials, which no IAM user has) are refused there too. moto's check of request
signatures is left out: it fails on a `/` in a query value (`list`'s prefix, `versions/`); which
user signed a request, and what its policy allows, is still checked.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

import pytest


@contextmanager
def s3_credentials(monkeypatch: pytest.MonkeyPatch, key_id: str, secret: str) -> Iterator[None]:
    """Permissions enforced, and stores (`S3Store`) made inside the block sign with these
    credentials: boto3's default session, which keeps the credentials it first found, is made
    anew from the environment."""
    import boto3
    from moto.core.authorization import enable_iam_authentication
    from moto.iam.access_control import S3IAMRequest

    with monkeypatch.context() as patch:
        patch.setattr(S3IAMRequest, "check_signature", lambda self: None)
        patch.setenv("AWS_ACCESS_KEY_ID", key_id)
        patch.setenv("AWS_SECRET_ACCESS_KEY", secret)
        patch.setattr(boto3, "DEFAULT_SESSION", None)
        with enable_iam_authentication():
            yield


@contextmanager
def s3_user(endpoint: str, monkeypatch: pytest.MonkeyPatch, statements: list[dict]) -> Iterator[None]:
    """`s3_credentials` of a new IAM user whose inline policy is `statements`."""
    import boto3

    iam = boto3.client("iam", endpoint_url=endpoint, region_name="us-east-1")
    name = f"user-{uuid.uuid4().hex[:12]}"
    iam.create_user(UserName=name)
    policy = json.dumps({"Version": "2012-10-17", "Statement": statements})
    iam.put_user_policy(UserName=name, PolicyName="s3", PolicyDocument=policy)
    key = iam.create_access_key(UserName=name)["AccessKey"]
    with s3_credentials(monkeypatch, key["AccessKeyId"], key["SecretAccessKey"]):
        yield


def allow(actions: list[str], resource: str = "*") -> dict:
    return {"Effect": "Allow", "Action": actions, "Resource": resource}


def deny(actions: list[str], resource: str) -> dict:
    return {"Effect": "Deny", "Action": actions, "Resource": resource}
