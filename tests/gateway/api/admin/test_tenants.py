"""Tenants and keys made at run time through the operator's API, as every gateway sees them; usage
counted per tenant and key, read back as JSON, JSON lines and CSV; token quotas per day."""

from __future__ import annotations

import asyncio
import csv
import io
import json
import time
import uuid

import pytest

from cache.l2 import RedisConfig, connect
from gateway.tenancy.tenants import ACCOUNTS_POLL_S, open_tenants
from gateway.tenancy.usage import UsageLedger, open_ledger
from gateway.tenancy.usage_event import UsageEvent
from tests.gateway.gateway_setup import KEYS, auth
from tests.redis_server import RedisServer

OPERATOR = auth("operator")


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def new_tenant(client, **settings) -> tuple[str, str, str]:
    """A fresh run-time tenant and a key of it: (tenant id, key, key id)."""
    tenant_id = f"acme-{uuid.uuid4().hex[:8]}"
    r = client.post("/v1/tenants", headers=OPERATOR, json={"id": tenant_id, **settings})
    assert r.status_code == 201, r.text
    r = client.post(f"/v1/tenants/{tenant_id}/keys", headers=OPERATOR, json={"name": "ci"})
    assert r.status_code == 201, r.text
    return tenant_id, r.json()["key"], r.json()["id"]


def models(client, key: str) -> list[str]:
    r = client.get("/v1/models", headers=bearer(key))
    assert r.status_code == 200, r.text
    return [m["id"] for m in r.json()["data"]]


def test_a_tenant_and_its_keys_from_creation_to_deletion(client) -> None:
    tenant_id, key, key_id = new_tenant(client, adapters=["a"], requests_per_min=1000)
    assert models(client, key) == ["tiny", "a"]  # its ACL: the base and "a" only
    listed = client.get(f"/v1/tenants/{tenant_id}/keys", headers=OPERATOR).json()["data"]
    assert [k["id"] for k in listed] == [key_id] and key not in json.dumps(listed)  # shown once, never again

    rotated = client.post(f"/v1/tenants/{tenant_id}/keys/{key_id}/rotate", headers=OPERATOR, json={}).json()
    assert rotated["replaces"] == key_id and rotated["key"] != key
    r = client.get("/v1/models", headers=bearer(key))
    assert r.status_code == 401 and "expired" in r.json()["error"]["message"]  # rotation without grace: refused now
    assert models(client, rotated["key"]) == ["tiny", "a"]

    r = client.patch(f"/v1/tenants/{tenant_id}", headers=OPERATOR, json={"adapters": "*", "disabled": True})
    assert r.status_code == 200 and r.json()["is_disabled"] is True
    r = client.get("/v1/models", headers=bearer(rotated["key"]))
    assert r.status_code == 403 and r.json()["error"]["code"] == "tenant_disabled"
    client.patch(f"/v1/tenants/{tenant_id}", headers=OPERATOR, json={"disabled": False})
    assert "b" in models(client, rotated["key"])  # the new ACL

    revoked = client.delete(f"/v1/tenants/{tenant_id}/keys/{rotated['id']}", headers=OPERATOR)
    assert revoked.status_code == 200 and revoked.json()["revoked_s"] is not None
    r = client.get("/v1/models", headers=bearer(rotated["key"]))
    assert r.status_code == 401 and "revoked" in r.json()["error"]["message"]

    third = client.post(f"/v1/tenants/{tenant_id}/keys", headers=OPERATOR, json={}).json()
    assert models(client, third["key"])
    assert client.delete(f"/v1/tenants/{tenant_id}", headers=OPERATOR).json()["deleted"] is True
    assert client.get("/v1/models", headers=bearer(third["key"])).status_code == 401
    assert client.get(f"/v1/tenants/{tenant_id}", headers=OPERATOR).status_code == 404
    again = client.post("/v1/tenants", headers=OPERATOR, json={"id": tenant_id})  # its usage and cache stay its own
    assert again.status_code == 409 and "never used again" in again.json()["error"]["message"]


@pytest.mark.parametrize(("method", "path", "body", "status", "code"), [
    ("post", "/v1/tenants", {"id": "t1"}, 409, "config_tenant"),  # the config's tenants are the bootstrap
    ("patch", "/v1/tenants/t1", {"tokens_per_day": 5}, 409, "config_tenant"),
    ("delete", "/v1/tenants/t1", None, 409, "config_tenant"),
    ("post", "/v1/tenants", {"id": "bad id!"}, 400, "invalid_value"),
    ("post", "/v1/tenants", {"id": "ok-id", "tokens_per_day": -1}, 400, "invalid_value"),
    ("post", "/v1/tenants", {"id": "ok-id", "colour": "red"}, 400, "invalid_value"),
    ("post", "/v1/tenants", {"id": "anonymous"}, 409, "tenant_exists"),
    ("patch", "/v1/tenants/nobody", {"tokens_per_day": 5}, 404, "tenant_not_found"),
    ("post", "/v1/tenants/nobody/keys", {}, 404, "tenant_not_found"),
])
def test_refused_changes_say_why_and_change_nothing(client, method, path, body, status, code) -> None:
    before = client.get("/v1/tenants", headers=OPERATOR).json()["data"]
    r = getattr(client, method)(path, headers=OPERATOR, **({} if body is None else {"json": body}))
    assert r.status_code == status and r.json()["error"]["code"] == code, r.text
    assert client.get("/v1/tenants", headers=OPERATOR).json()["data"] == before


def test_only_the_operator_manages_tenants(client) -> None:
    assert client.get("/v1/tenants", headers=auth("t1")).status_code == 401
    assert client.post("/v1/tenants", json={"id": "x"}).status_code == 401
    listed = {t["id"]: t for t in client.get("/v1/tenants", headers=OPERATOR).json()["data"]}
    assert listed["t1"]["source"] == "config" and listed["t2"]["adapters"] == ["b"]
    assert KEYS["t1"] not in json.dumps(listed)


def test_another_gateway_sees_a_change_within_the_bound(client) -> None:
    """A second gateway's view of the same Redis: a new key works there, a revoked one is refused,
    within ACCOUNTS_POLL_S of the change."""
    other = open_tenants(client.app.state.gateway.config)

    async def status_of(key: str) -> int | None:
        await other.refresh_if_stale()
        try:
            other.authenticate(f"Bearer {key}")
        except Exception as e:  # noqa: BLE001 - GatewayError
            return e.status
        return None

    async def until(key: str, wanted: int | None) -> float:
        started = time.monotonic()
        while await status_of(key) != wanted:
            assert time.monotonic() - started < 3 * ACCOUNTS_POLL_S, f"{key[:10]}... not {wanted} on the other gateway"
            await asyncio.sleep(0.01)
        return time.monotonic() - started

    async def scenario() -> tuple[float, float]:
        await other.refresh_if_stale()
        tenant_id, key, key_id = await asyncio.to_thread(new_tenant, client)
        took_new_s = await until(key, None)
        await asyncio.to_thread(client.delete, f"/v1/tenants/{tenant_id}/keys/{key_id}", headers=OPERATOR)
        return took_new_s, await until(key, 401)

    took_new_s, took_revoked_s = asyncio.run(scenario())
    assert took_new_s <= ACCOUNTS_POLL_S + 0.25 and took_revoked_s <= ACCOUNTS_POLL_S + 0.25, (took_new_s, took_revoked_s)


def _chat(client, key: str, **extra) -> dict:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "count to ten"}], "max_tokens": 6, "temperature": 0,
            **extra}
    r = client.post("/v1/chat/completions", headers=bearer(key), json=body)
    assert r.status_code == 200, r.text
    return r.json()["usage"]


def _streamed_usage(client, key: str) -> dict:
    body = {"model": "a", "prompt": "one two three", "max_tokens": 5, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    with client.stream("POST", "/v1/completions", headers=bearer(key), json=body) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    return events[-1]["usage"]


def test_usage_is_what_the_answers_said_in_every_format(client) -> None:
    tenant_id, key, key_id = new_tenant(client)
    answers = [_chat(client, key), _chat(client, key, n=2), _streamed_usage(client, key)]
    r = client.get("/v1/usage", headers=bearer(key))
    assert r.status_code == 200, r.text
    body = r.json()
    totals = body["totals"]
    assert totals["requests"] == 3
    assert totals["prompt_tokens"] == sum(a["prompt_tokens"] for a in answers)
    assert totals["completion_tokens"] == sum(a["completion_tokens"] for a in answers)
    assert totals["cached_tokens"] == sum(a["prompt_tokens_details"]["cached_tokens"] for a in answers)
    assert {(row["key_id"], row["adapter"]) for row in body["data"]} == {(key_id, "base"), (key_id, "a")}
    assert totals["finish_length"] + totals["finish_stop"] == 3

    as_lines = [json.loads(line) for line in client.get("/v1/usage?format=jsonl", headers=bearer(key)).text.splitlines()]
    as_csv = list(csv.DictReader(io.StringIO(client.get("/v1/usage?format=csv", headers=bearer(key)).text)))
    assert as_lines == body["data"]
    assert [{k: str(v) for k, v in row.items()} for row in body["data"]] == as_csv
    operator = client.get(f"/v1/usage?tenant={tenant_id}", headers=OPERATOR).json()
    assert operator["totals"] == totals  # the operator reads any tenant's
    assert client.get(f"/v1/usage?tenant={tenant_id}", headers=auth("t1")).status_code == 403  # a tenant, only its own
    now = time.gmtime()
    year, month = (now.tm_year, now.tm_mon - 1) if now.tm_mon > 1 else (now.tm_year - 1, 12)
    last_month = client.get(f"/v1/usage?start={year:04d}-{month:02d}-01&end={year:04d}-{month:02d}-02", headers=bearer(key)).json()
    assert last_month["totals"]["requests"] == 0
    assert client.get("/v1/usage?start=2020-01-01&end=2026-01-01", headers=bearer(key)).status_code == 400
    for bad in ("start=1e15&end=1000000000003600", "start=nan", "end=inf", "start=-5", "start=tomorrow", "start=9&end=3"):
        r = client.get(f"/v1/usage?{bad}", headers=bearer(key))
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_value", (bad, r.text)

    # a gateway started again reads the same counts (they are in Redis, not in the process)
    fresh = open_ledger(client.app.state.gateway.config.cache.redis)
    rows = asyncio.run(fresh.rows([tenant_id], time.time() - 7200, time.time() + 1))
    assert sum(row["completion_tokens"] for row in rows) == totals["completion_tokens"]


def test_a_token_quota_per_day_refuses_with_when_it_resets(client) -> None:
    tenant_id, key, _ = new_tenant(client, tokens_per_day=40)
    first = _chat(client, key)  # under the quota: served, and counted
    assert first["total_tokens"] > 0
    while True:  # the rest of the day's tokens
        r = client.post("/v1/chat/completions", headers=bearer(key),
                        json={"messages": [{"role": "user", "content": "count to ten"}], "max_tokens": 6})
        if r.status_code != 200:
            break
    assert r.status_code == 429, r.text
    error = r.json()["error"]
    assert error["code"] == "quota_exceeded" and "per day (40 tokens)" in error["message"] and "resets at" in error["message"]
    assert 0 < int(r.headers["retry-after"]) <= 86400
    used = client.get("/v1/usage", headers=bearer(key)).json()["totals"]
    assert used["prompt_tokens"] + used["completion_tokens"] <= 40 + first["total_tokens"]  # one request may cross it


def test_usage_waits_for_redis_and_is_written_once() -> None:
    """Redis not answering (paused): the count waits and is written when it answers again; the
    write that timed out but ran later, and its retry, count once."""
    server = RedisServer().start()
    try:
        import redis

        async def scenario() -> list[dict]:
            ledger = UsageLedger(connect(RedisConfig(url=server.url, timeout_s=0.2), is_async=True), "usage-test")
            await ledger.record(UsageEvent("r1", "acme", "k1", "base", "tiny", 10, 4, 3, "stop", time.time()))
            redis.Redis(port=server.port).execute_command("CLIENT", "PAUSE", 1500, "ALL")
            await ledger.record(UsageEvent("r2", "acme", "k1", "base", "tiny", 5, 0, 2, "length", time.time()))
            assert len(ledger._pending) == 1  # kept
            for _ in range(100):
                if not ledger._pending:
                    break
                await asyncio.sleep(0.05)
            return await ledger.rows(["acme"], time.time() - 3600, time.time() + 1)

        rows = asyncio.run(scenario())
        assert [(r["requests"], r["prompt_tokens"], r["completion_tokens"], r["finish_length"]) for r in rows] == [(2, 15, 5, 1)]
    finally:
        server.stop()


def test_a_failover_retry_and_a_cancelled_stream_are_counted_once(served) -> None:
    """A request whose replicas die before answering is served by another and counted once; a
    stream the client leaves counts its prompt and what it was sent, as cancelled."""
    client, pool = served
    tenant_id, key, _ = new_tenant(client)
    failures = client.app.state.gateway.metrics.failures.labels("s1-1")
    before = failures._value.get()
    pool.killed.add("s1-0")
    pool.fail_after["s1-1"] = 0  # "a" is on s1 (one replica gone, one dying before a token) and on s2
    try:
        replies = [client.post("/v1/completions", headers=bearer(key), json={"model": "a", "prompt": f"{i} two", "max_tokens": 4})
                   for i in range(6)]
    finally:
        pool.fail_after.clear()
        pool.killed.clear()
    assert all(r.status_code == 200 and r.headers["x-loraplex-replica"] == "s2-0" for r in replies)
    assert failures._value.get() > before  # some went to s1-1 first, and were retried on s2-0
    answered = {k: sum(r.json()["usage"][k] for r in replies) for k in ("prompt_tokens", "completion_tokens")}
    body = {"model": "tiny", "prompt": "one two three four", "max_tokens": 60, "stream": True, "ignore_eos": True}
    with client.stream("POST", "/v1/completions", headers=bearer(key), json=body) as streamed:
        lines = streamed.iter_lines()
        sent = [next(lines) for _ in range(3)]  # then the client leaves
    assert sent[0].startswith("data: {")
    for _ in range(100):
        totals = client.get("/v1/usage", headers=bearer(key)).json()["totals"]
        if totals["requests"] == 7:
            break
        time.sleep(0.05)
    assert totals["requests"] == 7 and totals["finish_cancelled"] == 1, totals
    assert totals["prompt_tokens"] > answered["prompt_tokens"]  # the cancelled one's prompt too
    assert answered["completion_tokens"] <= totals["completion_tokens"] < answered["completion_tokens"] + 60


def test_no_tenants_in_the_config_never_opens_the_deployment(tiny_llama, tmp_path) -> None:
    """Only `auth: none` opens a deployment: with an operator key and no config tenants, a request
    without a key is refused before the first tenant is made, after the last is deleted, and after
    the state store lost every record, on a gateway running then and on one started after."""
    import redis
    from fastapi.testclient import TestClient

    from tests.gateway.gateway_setup import local_serving, tiny_config

    prefix = f"loraplex-test-{uuid.uuid4().hex}"
    config = tiny_config(tiny_llama, tmp_path, prefix, tenants=[], state={"ephemeral": True, "stale_after_s": 1.0})
    with local_serving(config) as (app, _), TestClient(app) as client:
        assert client.get("/v1/models").status_code == 401
        tenant_id, key, _ = new_tenant(client)
        assert models(client, key)
        client.delete(f"/v1/tenants/{tenant_id}", headers=OPERATOR)
        assert client.get("/v1/models").status_code == 401
        kept_id, kept_key, _ = new_tenant(client)
        assert models(client, kept_key)
        r = redis.Redis()
        for stored in r.scan_iter(f"{prefix}:*"):  # the state store lost everything
            r.delete(stored)
        time.sleep(1.0 + ACCOUNTS_POLL_S)  # past stale_after_s: the gateway's last good read is too old to serve from
        assert client.get("/v1/models").status_code == 401
        r = client.get("/v1/models", headers=bearer(kept_key))
        assert r.status_code == 503 and r.json()["error"]["code"] == "tenants_unavailable"
        assert client.get("/health", headers=OPERATOR).json()["state"]["went_back"]
        new_tenant(client)  # the operator's next change: a version above every earlier one
        assert client.get("/v1/models", headers=bearer(kept_key)).status_code == 401  # gone, not back
    with local_serving(config) as (app, _), TestClient(app) as client:  # a gateway started after the loss
        assert client.get("/v1/models").status_code == 401
        assert client.get("/v1/models", headers=bearer(kept_key)).status_code == 401


def test_auth_none_is_the_only_open_deployment(tiny_llama, tmp_path) -> None:
    from fastapi.testclient import TestClient

    from tests.gateway.gateway_setup import local_serving, tiny_config

    config = tiny_config(tiny_llama, tmp_path, f"loraplex-test-{uuid.uuid4().hex}", tenants=[], operator_key_sha256=[],
                         auth="none")
    with local_serving(config) as (app, _), TestClient(app) as client:
        assert client.get("/v1/models").status_code == 200  # anonymous, as the config says
        assert client.get("/v1/usage").status_code == 200  # no operator key either: operator routes open too
        # but no credentials are minted by an anonymous caller: they would outlive the open mode
        r = client.post("/v1/tenants", json={"id": "squatter"})
        assert r.status_code == 403 and r.json()["error"]["code"] == "operator_only"
        assert client.post("/v1/operator/keys", json={"scopes": ["admin"]}).status_code == 403


def test_a_request_that_runs_out_its_deadline_is_counted(client) -> None:
    """Not streamed, stopped by its deadline (504): it ran, so its prompt and what it generated count."""
    _, key, _ = new_tenant(client)
    body = {"model": "tiny", "prompt": "one two three", "max_tokens": 110, "ignore_eos": True, "timeout_s": 0.06}
    r = client.post("/v1/completions", headers=bearer(key), json=body)
    assert r.status_code == 504, r.text
    for _ in range(100):
        totals = client.get("/v1/usage", headers=bearer(key)).json()["totals"]
        if totals["requests"]:
            break
        time.sleep(0.05)
    assert totals["requests"] == 1 and totals["finish_error"] == 1 and totals["prompt_tokens"] > 0
    assert totals["completion_tokens"] < 110  # what it made before its deadline (on a fast machine, some)


def test_a_key_made_through_another_gateway_works_here_at_once(client) -> None:
    """A key this gateway has not read yet is looked up at once, not refused until the next poll: a client
    that rotates its key and sends the next request to another gateway replica is not refused."""
    other = open_tenants(client.app.state.gateway.config)

    async def scenario() -> int:
        await other.refresh_if_stale()  # this gateway's view: read just now
        _, key, _ = await asyncio.to_thread(new_tenant, client)
        tenant = await other.authenticate_fresh(f"Bearer {key}")  # within the poll bound, no sleep
        assert tenant.is_runtime
        with pytest.raises(Exception) as refused:  # noqa: PT011 - GatewayError
            await other.authenticate_fresh("Bearer sk-lp-never-made")
        return refused.value.status

    assert asyncio.run(scenario()) == 401


def test_a_key_not_known_here_while_the_state_store_cannot_be_read_is_a_503_not_a_401(client, monkeypatch) -> None:
    """A key made a moment ago cannot be told from a bad one while the records cannot be read: the answer
    says to retry (503), never that the key is invalid."""
    from gateway.registry.records import RegistryUnavailable

    other = open_tenants(client.app.state.gateway.config)

    async def down() -> int:
        raise RegistryUnavailable("the tenants records (Redis) is unavailable: ConnectionError")

    async def scenario() -> tuple[int, int]:
        await other.refresh_if_stale()
        _, key, _ = await asyncio.to_thread(new_tenant, client)
        monkeypatch.setattr(other.accounts.records, "version", down)
        with pytest.raises(Exception) as refused:  # noqa: PT011 - GatewayError
            await other.authenticate_fresh(f"Bearer {key}")
        monkeypatch.undo()
        other._reads.read_s = float("-inf")  # the store answers again (past its back-off)
        return refused.value.status, (await other.authenticate_fresh(f"Bearer {key}")).is_runtime

    assert asyncio.run(scenario()) == (503, True)
