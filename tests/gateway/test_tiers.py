"""Adapter tiers end to end (in process: real workers on a tiny model, real Redis, the app through
TestClient): a shard of two replicas whose device tier holds two adapters (the deploy-time one
among them) serves registered adapters beyond it, loaded on first use, and the gateway sends an
adapter's requests to the replica that has it on its device."""

from __future__ import annotations

import uuid

import pytest
from fastapi.testclient import TestClient

from tests.gateway.api.admin.test_adapters import adapter_file, assert_same_output, greedy, upload
from tests.gateway.gateway_setup import KEYS, auth, digest, local_serving, tiny_config


@pytest.fixture(scope="module")
def setup(tiny_llama, tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiers")
    config = tiny_config(tiny_llama, directory, f"loraplex-test-{uuid.uuid4().hex}",
                         adapters=[{"name": "a", "path": "a.gguf"}], shards=[{"name": "s1", "adapters": ["a"], "replicas": 2}],
                         tenants=[{"id": "t1", "key_sha256": [digest(KEYS["t1"])]}],
                         residency={"device_adapters": 2, "host_bytes": 0})
    with local_serving(config) as (app, pool), TestClient(app) as client:
        yield client, pool, directory, app.state.gateway


def promotions(pool) -> int:
    return sum(sum(w.residency.stats.promotions.values()) for w in pool.workers.values())


def test_registered_adapters_beyond_the_device_tier_are_served_and_requests_go_where_they_are(setup, tiny_llama) -> None:
    client, pool, directory, gateway = setup
    names = [f"tier{i}" for i in range(3)]
    for i, name in enumerate(names):
        r = upload(client, name, adapter_file(tiny_llama, directory / f"{name}.gguf", 60 + i))
        assert r.status_code == 201, r.text
    first = {name: greedy(client, name) for name in names}
    assert all(r.status_code == 200 for r in first.values()), [r.text for r in first.values()]
    for worker in pool.workers.values():  # the budget held on both replicas: the deploy-time one and one more
        assert len(worker.runner.adapters) <= 2 and worker.residency.residents()["device"][0] <= 2
    again = greedy(client, names[0])  # evicted by the others meanwhile on the replica that served it
    assert_same_output(again, first[names[0]])
    before = promotions(pool)
    for i in range(8):  # prompts of their own (other affinity keys): still the replica that has it on its device
        r = client.post("/v1/completions", headers=auth(),
                        json={"model": names[0], "prompt": f"prompt number {i} " * 3, "max_tokens": 2})
        assert r.status_code == 200, r.text
    assert promotions(pool) == before  # not one load more
    metrics = client.get("/metrics", headers=auth("operator")).text
    assert 'loraplex_gateway_routed_residency_total{tier="device"}' in metrics
    assert 'loraplex_worker_adapter_promotions_total{' in metrics
