"""The in-process API server the tests of this package share: one per test module."""

from __future__ import annotations

import uuid

import pytest
from fastapi.testclient import TestClient

from tests.gateway.gateway_setup import local_serving, tiny_config


@pytest.fixture(scope="module")
def served(tiny_llama, tmp_path_factory):
    prefix = f"loraplex-test-{uuid.uuid4().hex}"
    config = tiny_config(tiny_llama, tmp_path_factory.mktemp("gw"), prefix)
    with local_serving(config) as (app, pool), TestClient(app) as client:
        yield client, pool


@pytest.fixture
def client(served):
    return served[0]
