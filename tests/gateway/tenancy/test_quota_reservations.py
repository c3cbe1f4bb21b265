"""Token quotas that hold under concurrency (gateway/tenancy/quota.py): reservations at admission, settled
by the usage count, shared by gateways in the machine's Redis (own prefix), expiring when a gateway
dies; refused (503) when they cannot be checked; the usage spool; the per-minute limit settled too."""

from __future__ import annotations

import asyncio
import random
import time
import uuid

import httpx
import pytest
import redis
import redis.asyncio
from fastapi.testclient import TestClient

from cache.l2 import RedisConfig, connect
from gateway.api.app import create_app
from gateway.catalog import Catalog
from gateway.compose import Gateway
from gateway.tenancy.quota import QuotaExceeded, period_id
from gateway.tenancy.ratelimit import RateLimiter
from gateway.tenancy.usage import UsageLedger
from gateway.tenancy.usage_event import UsageEvent
from tests.gateway.gateway_setup import digest, local_serving, tiny_config
from tests.redis_server import RedisServer

DAY = {"day": 200, "month": None}
TENANTS = {  # id: (key, limits)
    "capped": ("key-capped", {"tokens_per_day": 100}),
    "streamer": ("key-streamer", {"tokens_per_day": 200}),
    "choosy": ("key-choosy", {"tokens_per_month": 30}),
    "minute": ("key-minute", {"tokens_per_min": 100}),
    "batcher": ("key-batcher", {"tokens_per_day": 100}),
}
PROMPT = [5, 7, 9, 11]  # four tokens
EOS = 2  # the tiny model's


def bearer(tenant: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {TENANTS[tenant][0]}"}


class Clock:
    def __init__(self) -> None:
        self.now_s = time.time()

    def __call__(self) -> float:
        return self.now_s


def event(request_id: str, tenant: str, prompt: int, completion: int, admitted_s: float | None) -> UsageEvent:
    return UsageEvent(request_id, tenant, "k1", "base", "tiny", prompt, 0, completion, "stop", time.time(), admitted_s)


async def counted_and_held(client, ledger: UsageLedger, tenant: str, at_s: float) -> tuple[int, int]:
    """The day's tokens counted and reserved, read at one instant (one transaction)."""
    resv, _ = ledger._reservation_keys(tenant)
    async with client.pipeline(transaction=True) as pipe:
        pipe.hget(ledger._period_key(tenant, "day", at_s), "tokens")
        pipe.hget(resv, f"d:{period_id('day', at_s)}")
        counted, held = await pipe.execute()
    return int(counted or 0), int(held or 0)


# the ledger, as two gateways share it


def test_concurrent_requests_through_two_gateways_never_pass_the_quota(prefix) -> None:
    """32 requests at once, half through each of two ledgers (two gateways), each reserving its
    prompt and n=2 x max_tokens: counted + reserved never exceeds the quota (sampled throughout),
    nor does the usage counted; every end settles, so nothing stays reserved."""
    quota, prompt, max_tokens, n = 200, 4, 8, 2
    asked = prompt + n * max_tokens  # 20: at most 10 at once

    async def scenario() -> tuple[int, list[int], int, int]:
        clients = [redis.asyncio.Redis() for _ in range(3)]
        one, other = UsageLedger(clients[0], prefix), UsageLedger(clients[1], prefix)
        now_s = time.time()
        peaks, used, is_running = [], [], True

        async def sample() -> None:
            while is_running:
                peaks.append(sum(await counted_and_held(clients[2], one, "acme", now_s)))
                await asyncio.sleep(0.001)

        async def request(i: int, rng: random.Random) -> None:
            ledger = (one, other)[i % 2]
            await asyncio.sleep(rng.uniform(0, 0.05))
            try:
                reservation = await ledger.reserve("acme", f"r{i}", asked, {"day": quota, "month": None}, 60.0)
            except QuotaExceeded as e:
                assert e.num_left <= quota and "per day (200 tokens)" in str(e)
                return
            await asyncio.sleep(rng.uniform(0, 0.02))
            completion = rng.randint(0, n * max_tokens)
            used.append(prompt + completion)
            await ledger.record(event(f"r{i}", "acme", prompt, completion, reservation.at_s))

        sampler = asyncio.create_task(sample())
        rng = random.Random(7)
        await asyncio.gather(*(request(i, random.Random(rng.random())) for i in range(32)))
        is_running = False
        await sampler
        counted, held = await counted_and_held(clients[2], one, "acme", now_s)
        for client in clients:
            await client.aclose()
        return counted, used, held, max(peaks)

    counted, used, held, peak = asyncio.run(scenario())
    assert peak <= quota  # the bound: 0 tokens over, at every instant sampled
    assert counted == sum(used) <= quota and held == 0  # all settled: what they used, nothing held
    assert len(used) >= quota // asked  # and the quota is used: at least as many as fit at their reservations


def test_a_dead_gateways_reservation_expires_and_a_resent_count_settles_once(prefix) -> None:
    clock = Clock()

    async def scenario() -> None:
        client = redis.asyncio.Redis()
        dead, alive = UsageLedger(client, prefix, clock), UsageLedger(client, prefix, clock)
        await dead.reserve("acme", "lost", 150, DAY, 10.0)  # its gateway dies holding it
        with pytest.raises(QuotaExceeded) as refused:
            await alive.reserve("acme", "r1", 100, DAY, 10.0)
        assert refused.value.num_left == 200 and refused.value.retry_after_s == 1  # held, not used: retry soon
        clock.now_s += 10.5
        r1 = await alive.reserve("acme", "r1", 100, DAY, 10.0)  # "lost" expired: cleaned by this reserve
        resv, expiries = alive._reservation_keys("acme")
        assert await client.hget(resv, "r:lost") is None and await client.zscore(expiries, "lost") is None
        r2 = await alive.reserve("acme", "r2", 60, DAY, 10.0)
        done = event("r1", "acme", 10, 30, r1.at_s)
        await alive.record(done)
        await alive.record(done)  # sent again: its reply was lost
        assert await counted_and_held(client, alive, "acme", clock.now_s) == (40, 60)  # counted once, r2 still held
        with pytest.raises(QuotaExceeded) as refused:
            await alive.reserve("acme", "r3", 101, DAY, 10.0)
        assert refused.value.num_left == 160 and "160 tokens left (60 of them held by requests in flight)" in str(refused.value)
        alive.release(r2)  # never ran
        assert await alive.flush()
        assert await counted_and_held(client, alive, "acme", clock.now_s) == (40, 0)
        rows = await alive.rows(["acme"], clock.now_s - 3600, time.time() + 1)
        assert [(r["requests"], r["prompt_tokens"], r["completion_tokens"]) for r in rows] == [(1, 10, 30)]
        await client.aclose()

    asyncio.run(scenario())


def test_on_a_redis_cluster_a_tenants_quota_is_one_slots_script(tmp_path) -> None:
    from bench.cluster.redis_cluster import LocalRedisCluster

    with LocalRedisCluster(tmp_path).start() as cluster:
        async def scenario() -> list[dict]:
            client = connect(RedisConfig(url=cluster.url, cluster=True, key_prefix="lp", timeout_s=0.5), is_async=True)
            one, other = UsageLedger(client, "lp"), UsageLedger(client, "lp")  # two gateways
            assert one._reservation_keys("acme") == ["{lp:usage:acme}:resv", "{lp:usage:acme}:resv:exp"]
            r1 = await one.reserve("acme", "r1", 150, DAY, 60.0)
            with pytest.raises(QuotaExceeded):
                await other.reserve("acme", "r2", 100, DAY, 60.0)
            await one.record(event("r1", "acme", 10, 20, r1.at_s))
            await other.reserve("acme", "r2", 100, DAY, 60.0)
            rows = await other.rows(["acme"], time.time() - 3600, time.time() + 1)
            await client.aclose()
            return rows

        rows = asyncio.run(scenario())
    assert [(r["requests"], r["prompt_tokens"], r["completion_tokens"]) for r in rows] == [(1, 10, 20)]


def test_the_day_and_the_month_are_reserved_at_once() -> None:
    """Without Redis the same rules hold in memory; a month's quota binds as a day's does."""
    async def scenario() -> None:
        ledger = UsageLedger(None, "mem")
        r1 = await ledger.reserve("acme", "r1", 25, {"day": 100, "month": 30}, 10.0)
        with pytest.raises(QuotaExceeded, match="per month"):
            await ledger.reserve("acme", "r2", 6, {"day": 100, "month": 30}, 10.0)
        await ledger.record(event("r1", "acme", 5, 5, r1.at_s))  # used 10 of its 25
        await ledger.reserve("acme", "r2", 20, {"day": 100, "month": 30}, 10.0)

    asyncio.run(scenario())


# end to end: the app, two gateways over one Redis


@pytest.fixture(scope="module")
def served(tiny_llama, tmp_path_factory):
    prefix = f"loraplex-test-{uuid.uuid4().hex}"
    tenants = [{"id": t, "key_sha256": [digest(key)], **limits} for t, (key, limits) in TENANTS.items()]
    config = tiny_config(tiny_llama, tmp_path_factory.mktemp("gw"), prefix, tenants=tenants)
    with local_serving(config) as (app, pool), TestClient(app) as client:
        yield config, pool, client


def completion(tenant: str, max_tokens: int, **extra) -> tuple[dict, dict]:
    return bearer(tenant), {"model": "tiny", "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, **extra}


def test_two_gateways_with_16_requests_each_keep_the_day_quota(served) -> None:
    """Each request reserves 4 + 6 = 10 tokens and uses them all (ignore_eos): at most 10 of the 32
    fit the quota of 100; the others are 429 quota_exceeded, and the usage counted is <= 100."""
    config, pool, _ = served

    async def scenario() -> tuple[list[httpx.Response], dict]:
        gateways = [Gateway(config, Catalog(config), pool, RateLimiter(redis.asyncio.Redis(), config.cache.redis.key_prefix))
                    for _ in range(2)]
        apps = []
        for gateway in gateways:
            apps.append(app := create_app())
            app.state.gateway = gateway
        clients = [httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://gw") for app in apps]
        headers, body = completion("capped", 6, ignore_eos=True)
        replies = await asyncio.gather(*(clients[i % 2].post("/v1/completions", headers=headers, json=body)
                                         for i in range(32)))
        totals = (await clients[0].get("/v1/usage", headers=headers)).json()["totals"]
        for client in clients:
            await client.aclose()
        for gateway in gateways:
            await gateway.usage.client.aclose()
            await gateway.limiter.client.aclose()
        return replies, totals

    replies, totals = asyncio.run(scenario())
    served_ok = [r for r in replies if r.status_code == 200]
    refused = [r for r in replies if r.status_code != 200]
    assert all(r.status_code == 429 and r.json()["error"]["code"] == "quota_exceeded" and int(r.headers["retry-after"]) >= 1
               for r in refused), [r.text for r in refused]
    assert 1 <= len(served_ok) <= 10 and refused
    assert totals["requests"] == len(served_ok)
    assert totals["prompt_tokens"] + totals["completion_tokens"] == 10 * len(served_ok) <= 100


def test_n_choices_count_against_the_quota(served) -> None:
    _, _, client = served
    headers, body = completion("choosy", 10, n=3)  # 4 + 3 x 10 = 34 > 30
    r = client.post("/v1/completions", headers=headers, json=body)
    assert r.status_code == 429 and r.json()["error"]["code"] == "quota_exceeded", r.text
    assert "per month (30 tokens) has 30 tokens left" in r.json()["error"]["message"]
    assert r.json()["error"]["tokens_left"] == 30
    headers, body = completion("choosy", 10, n=2)  # 24 fits
    assert client.post("/v1/completions", headers=headers, json=body).status_code == 200


def test_a_stream_the_client_leaves_settles_its_reservation(served) -> None:
    config, _, client = served
    headers, body = completion("streamer", 120, stream=True, ignore_eos=True)  # reserves 124 of 200
    other_headers, other = completion("streamer", 80)  # 84
    with client.stream("POST", "/v1/completions", headers=headers, json=body) as streamed:
        lines = streamed.iter_lines()
        assert next(lines).startswith("data: {")
        r = client.post("/v1/completions", headers=other_headers, json=other)  # not while the stream holds 124
        assert r.status_code == 429 and r.json()["error"]["code"] == "quota_exceeded" and r.headers["retry-after"] == "1"
    for _ in range(200):  # the client left: its end counts what was sent, and gives back the rest
        r = client.post("/v1/completions", headers=other_headers, json=other)
        if r.status_code == 200:
            break
        time.sleep(0.05)
    assert r.status_code == 200, r.text
    held = redis.Redis().hgetall(f"{config.cache.redis.key_prefix}:usage:streamer:resv")
    assert not [field for field in held if field.startswith(b"r:")]
    totals = client.get("/v1/usage", headers=headers).json()["totals"]
    assert totals["finish_cancelled"] == 1 and totals["prompt_tokens"] + totals["completion_tokens"] <= 200, totals


def test_a_batch_refused_after_its_first_prompt_was_admitted_gives_that_back(served, monkeypatch) -> None:
    """llama-server's batch: its first prompt reserves 64 of 100, its second cannot (429); the
    first, dropped unrun with the refused request, is given back once collected."""
    import gc

    import gateway.requests.admission

    monkeypatch.setattr(gateway.requests.admission, "DROPPED_AFTER_S", 0.05)
    _, _, client = served
    r = client.post("/completion", headers=bearer("batcher"), json={"prompt": [PROMPT, PROMPT], "n_predict": 60})
    assert r.status_code == 429 and r.json()["error"]["code"] == "quota_exceeded", r.text
    for _ in range(100):
        gc.collect()
        r = client.post("/completion", headers=bearer("batcher"), json={"prompt": PROMPT, "n_predict": 60})
        if r.status_code == 200:
            break
        time.sleep(0.05)
    assert r.status_code == 200, r.text


def test_the_token_limit_gives_back_what_a_request_did_not_use(served) -> None:
    """Each request takes 4 + 80 of a 100 tokens/minute limit and uses ~5 (EOS is all but forced):
    without the refund the second would wait most of a minute."""
    _, _, client = served
    headers, body = completion("minute", 80, logit_bias={str(EOS): 100})
    first = client.post("/v1/completions", headers=headers, json=body)
    assert first.status_code == 200 and first.json()["usage"]["completion_tokens"] <= 2, first.text
    for _ in range(3):
        r = client.post("/v1/completions", headers=headers, json=body)
        assert r.status_code == 200, r.text


def test_a_tenant_with_a_quota_is_refused_while_redis_is_down(served) -> None:
    """The quota cannot be checked: 503 with Retry-After, never admitted unchecked; a tenant
    without a quota is served (its usage waits for Redis)."""
    config, pool, _ = served
    dead = RedisServer().start()
    dead.stop()  # nothing listens on its port

    async def scenario() -> tuple[httpx.Response, httpx.Response]:
        gateway = Gateway(config, Catalog(config), pool, RateLimiter(redis.asyncio.Redis(), config.cache.redis.key_prefix))
        gateway.admission.usage = UsageLedger(connect(RedisConfig(url=dead.url, timeout_s=0.2), is_async=True), "dead")
        app = create_app()
        app.state.gateway = gateway
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://gw") as client:
            headers, body = completion("capped", 2)
            refused = await client.post("/v1/completions", headers=headers, json=body)
            headers, body = completion("minute", 2)
            served = await client.post("/v1/completions", headers=headers, json=body)
        await gateway.limiter.client.aclose()
        return refused, served

    refused, served = asyncio.run(scenario())
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "quota_unavailable", refused.text
    assert int(refused.headers["retry-after"]) >= 1 and "cannot be reached" in refused.json()["error"]["message"]
    assert served.status_code == 200, served.text


# the spool


def test_a_request_running_past_its_reservations_lifetime_keeps_it_by_renewing(prefix) -> None:
    """A client that reads its stream slowly keeps the request running past its reservation's lifetime:
    its gateway renews the reservation, which then holds the quota as long as the request runs."""
    clock = Clock()

    async def scenario() -> None:
        client = redis.asyncio.Redis()
        ledger = UsageLedger(client, prefix, clock)
        held = await ledger.reserve("acme", "slow", 150, DAY, 10.0)
        clock.now_s += 9.0
        assert await ledger.renew(held, clock.now_s + 10.0)
        clock.now_s += 5.0  # past its first expiry: still held
        with pytest.raises(QuotaExceeded):
            await ledger.reserve("acme", "other", 100, DAY, 10.0)
        await ledger.record(event("slow", "acme", 10, 20, held.at_s))  # it ends: counted, released
        assert not await ledger.renew(held, clock.now_s + 10.0)  # not held any more: nothing renewed
        assert await ledger.reserve("acme", "other", 100, DAY, 10.0)
        await client.aclose()

    asyncio.run(scenario())
