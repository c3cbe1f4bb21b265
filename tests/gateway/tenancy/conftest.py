"""Fixtures of the tenancy tests."""

from __future__ import annotations

import uuid

import pytest
import redis


@pytest.fixture
def prefix():
    prefix = f"loraplex-test-{uuid.uuid4().hex}"
    yield prefix
    sync = redis.Redis()
    for key in sync.scan_iter(f"{prefix}:*"):
        sync.delete(key)
