"""The S3-compatible server (bench/cluster/s3_server.py) for tests of the adapter store; clients reach
it through the standard AWS variables, as a deployment's would."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from bench.cluster.s3_server import S3Server


@contextmanager
def running_s3() -> Iterator[S3Server]:
    """A started server with the AWS variables pointing at it in this process (and its children)."""
    server = S3Server().start()
    try:
        with pytest.MonkeyPatch.context() as patch:
            for name, value in server.env().items():
                patch.setenv(name, value)
            for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_CONFIG_FILE", "AWS_SHARED_CREDENTIALS_FILE"):
                patch.delenv(name, raising=False)
            yield server
    finally:
        server.stop()


def bucket_name(prefix: str = "loraplex-test") -> str:
    return f"{prefix}-{os.getpid()}-{time.monotonic_ns() % 10**9}"
