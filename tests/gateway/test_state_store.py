"""The state store (gateway/state.py): apart from the cache, checked at start, durable across a restart,
never opening the deployment or bringing a revoked key back when it loses its data, and refused
run-time keys once it has not been read within the stated bound."""

from __future__ import annotations

import asyncio
import shutil
import time
import uuid
from pathlib import Path

import pytest
import redis
from fastapi.testclient import TestClient

from cache.l2 import RedisConfig
from gateway.config import ConfigError, parse_config
from gateway.state import StateSettings, StateStoreRefused, check
from gateway.tenancy.tenants import ACCOUNTS_POLL_S
from tests.gateway.gateway_setup import KEYS, auth, local_serving, tiny_config
from tests.redis_server import RedisServer

OPERATOR = auth("operator")
BASE = {"adapters": [{"name": "a", "path": "a.gguf"}], "shards": [{"name": "s", "adapters": ["a"]}],
        "operator_key_sha256": ["0" * 64]}


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def new_tenant(client) -> tuple[str, str, str]:
    tenant_id = f"acme-{uuid.uuid4().hex[:8]}"
    assert client.post("/v1/tenants", headers=OPERATOR, json={"id": tenant_id}).status_code == 201
    r = client.post(f"/v1/tenants/{tenant_id}/keys", headers=OPERATOR, json={})
    assert r.status_code == 201, r.text
    return tenant_id, r.json()["key"], r.json()["id"]


# the config


@pytest.mark.parametrize(("state", "cache", "message"), [
    ({}, {}, "state.redis_url is not set: .* the cache's Redis, which may evict them"),
    ({}, {"redis_url": None}, "state.redis_url is not set: .* this process and its files"),
    ({"redis_url": "redis://127.0.0.1:6379/0"}, {}, "state.redis_url is the cache's Redis"),
])
def test_a_state_store_that_may_lose_state_is_refused_unless_said(state, cache, message) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_config({**BASE, "state": state, "cache": cache}, ".")
    assert parse_config({**BASE, "state": {**state, "ephemeral": True}, "cache": cache}, ".").state.ephemeral
    own = parse_config({**BASE, "state": {"redis_url": "redis://state:6379/0"}}, ".").state_redis()
    assert own.url == "redis://state:6379/0" and own.key_prefix == RedisConfig.key_prefix


@pytest.mark.parametrize(("change", "message"), [
    ({"auth": "none", "tenants": [{"id": "t", "key_sha256": ["1" * 64]}]}, "auth: none serves everyone anonymously"),
    ({"operator_key_sha256": []}, "no tenants and no operator key: nobody could call this deployment"),
    ({"http": {"host": "0.0.0.0"}, "operator_key_sha256": ["722b9a6d835dc075ce7c237e01e8c9e60f123933347afd5c52662a5c5dbc5ec6"]},
     "listens beyond loopback with 1 of the public example keys"),
    ({"http": {"host": "0.0.0.0"}, "auth": "none", "operator_key_sha256": []}, "listens beyond loopback with auth: none"),
    ({"http": {"host": "127.example.com"}, "auth": "none", "operator_key_sha256": []}, "listens beyond loopback"),
    ({"http": {"host": "::"}, "auth": "none", "operator_key_sha256": []}, "listens beyond loopback"),
])
def test_nobody_is_let_in_by_accident(change, message) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_config({**BASE, "state": {"ephemeral": True}, **change}, ".")
    if "http" in change:  # the operator says it means it
        allowed = {**change, "http": {**change["http"], "allow_insecure_bind": True}}
        assert parse_config({**BASE, "state": {"ephemeral": True}, **allowed}, ".").http.host == change["http"]["host"]
    assert parse_config({**BASE, "state": {"ephemeral": True}, "http": {"host": "0.0.0.0"}}, ".")  # own keys: fine


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.2", "::1", "localhost"])
def test_loopback_is_any_loopback_address(host) -> None:
    assert parse_config({**BASE, "state": {"ephemeral": True}, "auth": "none", "operator_key_sha256": [],
                         "http": {"host": host}}, ".").http.host == host


def test_the_bootstrap_operator_key_may_be_retired_where_run_time_keys_are_kept() -> None:
    """With a durable state store, operator keys made at run time may be all there is: the config may name none."""
    config = parse_config({**BASE, "operator_key_sha256": [], "state": {"redis_url": "redis://state:6379/0"}}, ".")
    assert config.auth == "keys" and not config.operator_key_sha256 and not config.tenants


def test_the_default_config_binds_loopback_only() -> None:
    from gateway.config import load_config

    config = load_config()
    assert config.exposure_error() is None
    public = config.model_copy(update={"http": config.http.model_copy(update={"host": "0.0.0.0"})})
    assert "public example keys" in public.exposure_error()  # what `loraplex serve --host 0.0.0.0` checks


# the check at start


def test_the_check_refuses_a_redis_that_evicts_or_keeps_nothing_on_disk(tmp_path: Path) -> None:
    cache_like = RedisServer(args=("--maxmemory", "10mb", "--maxmemory-policy", "allkeys-lru")).start()
    durable = RedisServer.durable(tmp_path).start()
    try:
        async def scenario() -> None:
            settings = StateSettings(redis_url=cache_like.url)
            with pytest.raises(StateStoreRefused) as refused:
                await check(settings, RedisConfig(cache_like.url))
            assert "maxmemory-policy is allkeys-lru" in str(refused.value) and "appendonly is off" in str(refused.value)
            await check(StateSettings(redis_url=durable.url), RedisConfig(durable.url))  # passes
            await check(StateSettings(redis_url=cache_like.url, ephemeral=True), RedisConfig(cache_like.url))  # said

        asyncio.run(scenario())
    finally:
        cache_like.stop()
        durable.stop()


def test_a_gateway_over_a_refused_state_store_serves_nobody(tiny_llama, tmp_path: Path) -> None:
    cache_like = RedisServer(args=("--maxmemory-policy", "allkeys-lru")).start()
    try:
        config = tiny_config(tiny_llama, tmp_path, f"loraplex-test-{uuid.uuid4().hex}",
                             state={"redis_url": cache_like.url})
        with local_serving(config) as (app, _), TestClient(app) as client:
            r = client.get("/v1/models", headers=auth("t1"))  # even the config's tenants: their usage would be lost
            assert r.status_code == 503 and r.json()["error"]["code"] == "state_store_refused"
            assert "allkeys-lru" in r.json()["error"]["message"]
            health = client.get("/health", headers=OPERATOR).json()
            assert health["status"] == "down" and health["state"]["status"] == "refused"
            fixed = redis.Redis(port=cache_like.port)
            fixed.config_set("maxmemory-policy", "noeviction")
            fixed.config_set("appendonly", "yes")
            deadline = time.monotonic() + 10
            while client.get("/v1/models", headers=auth("t1")).status_code != 200:  # checked again: it serves
                assert time.monotonic() < deadline, "a state store fixed while the gateway ran was never taken"
                time.sleep(0.2)
    finally:
        cache_like.stop()


# restarts and losses


@pytest.fixture
def durable(tmp_path: Path):
    """A private state store as production runs one (AOF in its own directory, no eviction): (server, its dir)."""
    data = tmp_path / "state"
    data.mkdir()
    state = RedisServer.durable(data).start()
    try:
        yield state, data
    finally:
        state.stop()


def kept_and_revoked(client) -> tuple[str, str]:
    """Two run-time tenants' keys: one live, one revoked."""
    _, kept, _ = new_tenant(client)
    tenant_id, revoked, revoked_id = new_tenant(client)
    assert client.delete(f"/v1/tenants/{tenant_id}/keys/{revoked_id}", headers=OPERATOR).status_code == 200
    return kept, revoked


def _durable_deployment(tiny_llama, tmp_path: Path, state: RedisServer, **state_settings):
    config = tiny_config(tiny_llama, tmp_path, f"loraplex-test-{uuid.uuid4().hex}",
                         state={"redis_url": state.url, "timeout_s": 0.5, **state_settings})
    return config


def test_a_state_store_restarted_keeps_every_key_and_revocation(tiny_llama, tmp_path: Path, durable) -> None:
    state, _ = durable
    config = _durable_deployment(tiny_llama, tmp_path, state)
    with local_serving(config) as (app, _), TestClient(app) as client:
        kept, revoked = kept_and_revoked(client)
        state.stop()  # killed (SIGKILL): what was acknowledged is in its append-only file
        state.start()
        time.sleep(ACCOUNTS_POLL_S + 0.1)
        assert client.get("/v1/models", headers=bearer(kept)).status_code == 200
        assert client.get("/v1/models", headers=bearer(revoked)).status_code == 401
        assert client.get("/v1/models").status_code == 401


def test_a_state_store_restarted_empty_opens_nothing_and_brings_no_key_back(tiny_llama, tmp_path: Path, durable) -> None:
    state, data = durable
    config = _durable_deployment(tiny_llama, tmp_path, state, stale_after_s=1.0)
    with local_serving(config) as (app, _), TestClient(app) as client:
        kept, revoked = kept_and_revoked(client)
        state.stop()
        shutil.rmtree(data)  # its disk lost too
        data.mkdir()
        state.start()
        time.sleep(1.0 + ACCOUNTS_POLL_S)
        assert client.get("/v1/models").status_code == 401  # never anonymous
        assert client.get("/v1/models", headers=bearer(revoked)).status_code == 401
        assert client.get("/v1/models", headers=bearer(kept)).status_code == 503  # the last good read is too old
        assert client.get("/v1/models", headers=auth("t1")).status_code == 200  # the config's keys go on
    with local_serving(config) as (app, _), TestClient(app) as client:  # a gateway started after the loss
        assert client.get("/v1/models").status_code == 401
        assert client.get("/v1/models", headers=bearer(revoked)).status_code == 401
        assert client.get("/v1/models", headers=bearer(kept)).status_code == 401


def test_an_unreachable_state_store_is_served_from_for_the_stated_bound_then_refused(tiny_llama, tmp_path: Path, durable) -> None:
    state, _ = durable
    config = _durable_deployment(tiny_llama, tmp_path, state, stale_after_s=2.0)
    with local_serving(config) as (app, _), TestClient(app) as client:
        _, key, _ = new_tenant(client)
        state.stop()
        assert client.get("/v1/models", headers=bearer(key)).status_code == 200  # within the bound: the last read
        time.sleep(2.2)
        r = client.get("/v1/models", headers=bearer(key))
        assert r.status_code == 503 and r.json()["error"]["code"] == "tenants_unavailable", r.text
        assert client.get("/v1/models", headers=auth("t1")).status_code == 200  # the config's keys need no read
        assert client.get("/health", headers=OPERATOR).json()["state"]["status"] == "stale"
        state.start()
        deadline = time.monotonic() + 15
        while client.get("/v1/models", headers=bearer(key)).status_code != 200:
            assert time.monotonic() < deadline, "the key did not come back once the store was reachable"
            time.sleep(0.2)


def test_a_cache_filled_past_maxmemory_loses_no_usage_key_or_adapter(tiny_llama, tmp_path: Path, durable) -> None:
    """The prefix cache's Redis evicts under load (allkeys-lru, a small maxmemory); the state store is apart."""
    from tests.gateway.gateway_setup import ATTN
    from tests.tinymodels import random_lora, write_adapter

    cache = RedisServer(args=("--maxmemory", "4mb", "--maxmemory-policy", "allkeys-lru")).start()
    state, _ = durable
    prefix = f"loraplex-test-{uuid.uuid4().hex}"
    try:
        config = tiny_config(tiny_llama, tmp_path, prefix, state={"redis_url": state.url},
                             cache={"redis_url": cache.url, "key_prefix": prefix, "chunk_tokens": 8})
        write_adapter(tmp_path / "mine.gguf", random_lora(tiny_llama, ATTN, 4, seed=9))
        with local_serving(config) as (app, _), TestClient(app) as client:
            tenant_id, key, _ = new_tenant(client)
            with open(tmp_path / "mine.gguf", "rb") as f:
                r = client.post("/v1/adapters", headers=bearer(key), data={"name": "mine"}, files={"file": f})
            assert r.status_code == 201, r.text
            filler = redis.Redis(port=cache.port)
            answered = 0
            for i in range(12):
                body = {"model": "mine", "prompt": f"{i} " + "word " * 12, "max_tokens": 4, "temperature": 0}
                r = client.post("/v1/completions", headers=bearer(key), json=body)
                assert r.status_code == 200, r.text
                answered += r.json()["usage"]["total_tokens"]
                for j in range(40):  # the cache under pressure: well past its maxmemory
                    filler.set(f"{prefix}:filler:{i}:{j}", b"x" * 32768)
            assert filler.info("stats")["evicted_keys"] > 0
            assert [k for k in filler.scan_iter(f"{prefix}:*") if b":filler:" not in k] != []  # the prefix cache's own
            assert not [k for k in filler.scan_iter(f"{prefix}:*") if b"usage" in k or b"tenants" in k or b"registry" in k]
            time.sleep(ACCOUNTS_POLL_S + 0.1)
            assert client.get("/v1/models", headers=bearer(key)).status_code == 200  # the key
            assert "mine" in [a["name"] for a in client.get("/v1/adapters", headers=bearer(key)).json()["data"]]
            totals = client.get("/v1/usage", headers=bearer(key)).json()["totals"]
            assert totals["requests"] == 12 and totals["prompt_tokens"] + totals["completion_tokens"] == answered
    finally:
        cache.stop()


# operators


def test_operator_keys_made_scoped_rotated_revoked_and_audited(tiny_llama, tmp_path: Path) -> None:
    config = tiny_config(tiny_llama, tmp_path, f"loraplex-test-{uuid.uuid4().hex}")
    with local_serving(config) as (app, _), TestClient(app) as client:
        r = client.post("/v1/operator/keys", headers=OPERATOR, json={"name": "billing", "scopes": ["usage"]})
        assert r.status_code == 201, r.text
        reader, reader_id = r.json()["key"], r.json()["id"]
        assert client.get("/v1/usage", headers=bearer(reader)).status_code == 200  # every tenant's usage: its scope
        r = client.post("/v1/tenants", headers=bearer(reader), json={"id": "nope"})
        assert r.status_code == 403 and "'tenants' scope" in r.json()["error"]["message"]
        assert client.get("/metrics", headers=bearer(reader)).status_code == 403
        assert client.post("/v1/operator/keys", headers=bearer(reader), json={"scopes": ["admin"]}).status_code == 403
        assert client.post("/v1/operator/keys", headers=OPERATOR, json={"scopes": ["root"]}).status_code == 400

        r = client.post("/v1/operator/keys", headers=OPERATOR, json={"name": "ops", "scopes": ["tenants", "observe"]})
        admin_of_tenants, ops_id = r.json()["key"], r.json()["id"]
        tenant_id = f"t-{uuid.uuid4().hex[:6]}"
        assert client.post("/v1/tenants", headers=bearer(admin_of_tenants), json={"id": tenant_id}).status_code == 201
        assert client.get("/metrics", headers=bearer(admin_of_tenants)).status_code == 200

        rotated = client.post(f"/v1/operator/keys/{reader_id}/rotate", headers=OPERATOR, json={})
        assert rotated.status_code == 201 and rotated.json()["scopes"] == ["usage"]
        assert client.get("/v1/usage", headers=bearer(reader)).status_code == 401  # no grace: ended now
        assert client.get("/v1/usage", headers=bearer(rotated.json()["key"])).status_code == 200
        assert client.delete(f"/v1/operator/keys/{ops_id}", headers=OPERATOR).status_code == 200
        assert client.post("/v1/tenants", headers=bearer(admin_of_tenants), json={"id": "x2"}).status_code == 401

        audit = client.get("/v1/operator/audit", headers=OPERATOR).json()["data"]
        actions = [(e["action"], e["operator"]) for e in audit]
        config_admin = client.get("/v1/operator/keys", headers=OPERATOR).json()["data"][0]["id"]
        assert actions == [("operator_key.issue", config_admin), ("operator_key.issue", config_admin),
                           ("tenant.create", ops_id), ("operator_key.rotate", config_admin),
                           ("operator_key.revoke", config_admin)]
        assert audit[2]["target"] == tenant_id and all(e["at"] > time.time() - 60 for e in audit)
        assert client.get("/v1/operator/audit", headers=auth("t1")).status_code == 401
        assert KEYS["operator"] not in str(audit)
        for since in ("nan", "inf", "-5", "1e20", "x"):
            assert client.get(f"/v1/operator/audit?since={since}", headers=OPERATOR).status_code == 400
        assert len(client.get(f"/v1/operator/audit?since={time.time() - 60}", headers=OPERATOR).json()["data"]) == 5


def test_an_operators_changes_to_shared_adapters_are_audited(tiny_llama, tmp_path: Path) -> None:
    from tests.gateway.gateway_setup import ATTN
    from tests.tinymodels import random_lora, write_adapter

    config = tiny_config(tiny_llama, tmp_path, f"loraplex-test-{uuid.uuid4().hex}")
    write_adapter(tmp_path / "shared.gguf", random_lora(tiny_llama, ATTN, 4, seed=12))
    with local_serving(config) as (app, _), TestClient(app) as client:
        r = client.post("/v1/operator/keys", headers=OPERATOR, json={"name": "adapters", "scopes": ["adapters"]})
        key, key_id = r.json()["key"], r.json()["id"]
        with open(tmp_path / "shared.gguf", "rb") as f:
            r = client.post("/v1/adapters", headers=bearer(key), data={"name": "house"}, files={"file": f})
        assert r.status_code == 201, r.text
        assert client.delete("/v1/adapters/house", headers=bearer(key)).status_code == 200
        audit = client.get("/v1/operator/audit", headers=OPERATOR).json()["data"]
        assert [(e["action"], e["operator"], e["target"]) for e in audit[-2:]] == [
            ("adapter.upload", key_id, "shared/house"), ("adapter.delete", key_id, "shared/house")]
        body = '{"lora_name": "odd", "lora_path": "adapters/a\\u0000b.gguf"}'  # valid JSON, no file name
        r = client.post("/v1/load_lora_adapter", headers={**OPERATOR, "Content-Type": "application/json"}, content=body)
        assert r.status_code in (400, 403) and r.json()["error"]["code"] in ("invalid_value", "path_not_allowed")
