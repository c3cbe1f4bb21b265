"""The in-process API server the tests of this package share: one per test module."""

from __future__ import annotations

import uuid

import pytest
import redis
from fastapi.testclient import TestClient

from tests.gateway.gateway_setup import local_app, tiny_config


@pytest.fixture(scope="module")
def served(tiny_llama, tmp_path_factory):
    prefix = f"loraplex-test-{uuid.uuid4().hex}"
    config = tiny_config(tiny_llama, tmp_path_factory.mktemp("gw"), prefix)
    app, pool = local_app(config)
    with TestClient(app) as client:
        yield client, pool
    pool.close()
    r = redis.Redis()
    for key in r.scan_iter(f"{prefix}:*"):
        r.delete(key)


@pytest.fixture
def client(served):
    return served[0]
