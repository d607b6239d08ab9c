"""A local S3-compatible server (moto) for tests and benchmarks: real HTTP, real boto3, no cloud.

Listens on 127.0.0.1 with a free port, in a thread of this process (tests) or in its own
process (benchmarks, so that serving requests does not compete with the caller for the GIL).
moto accepts any credentials: placeholders are set in the environment if none are (child
processes inherit them, so subscriber processes can connect).
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

from whetstone.errors import WhetstoneError


@contextmanager
def local_s3(bucket: str = "whetstone", own_process: bool = False) -> Iterator[str]:
    """Run a moto server with `bucket` created; yields its endpoint URL."""
    from whetstone.store.s3 import S3Store

    for name, value in [
        ("AWS_ACCESS_KEY_ID", "local"),
        ("AWS_SECRET_ACCESS_KEY", "local"),
        ("AWS_DEFAULT_REGION", "us-east-1"),
    ]:
        os.environ.setdefault(name, value)
    with _moto_process() if own_process else _moto_thread() as endpoint:
        S3Store(bucket, endpoint_url=endpoint).create_bucket()
        yield endpoint


@contextmanager
def _moto_thread() -> Iterator[str]:
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one log line per request otherwise
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        yield f"http://{host}:{port}"
    finally:
        server.stop()


@contextmanager
def _moto_process(timeout: float = 60) -> Iterator[str]:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    process = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + timeout
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if process.poll() is not None or time.monotonic() > deadline:
                    raise WhetstoneError(f"the moto S3 server did not start on 127.0.0.1:{port}") from None
                time.sleep(0.1)
        yield f"http://127.0.0.1:{port}"
    finally:
        process.terminate()
        process.wait(timeout=10)
