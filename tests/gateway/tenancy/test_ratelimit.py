"""Rate limits as a token bucket (GCRA), in the machine's Redis (own prefix) and per process: the
tokens a request did not use given back, and each gateway's share while it counts alone."""

from __future__ import annotations

import asyncio
import uuid

import pytest
import redis
import redis.asyncio

from gateway.errors import GatewayError
from gateway.tenancy.ratelimit import RateLimiter, TokenSpend
from gateway.tenancy.tenants import Tenant


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


class Limiter:
    """The async limiter driven from sync test code, on one event loop."""

    def __init__(self, client, prefix: str, clock: Clock) -> None:
        self.loop = asyncio.new_event_loop()
        self.limiter = RateLimiter(client, prefix, clock)

    def check(self, tenant: Tenant, tokens: int) -> None:
        self.loop.run_until_complete(self.limiter.check(tenant, tokens))

    def spend(self, tenant: Tenant, tokens: int) -> TokenSpend | None:
        return self.loop.run_until_complete(self.limiter.spend(tenant, tokens))

    def refund(self, spend: TokenSpend | None, num_used: int) -> None:
        self.loop.run_until_complete(self.limiter.refund(spend, num_used))


@pytest.fixture(params=["redis", "local"])
def limiter(request):
    prefix = f"loraplex-test-{uuid.uuid4().hex}"
    client = redis.asyncio.Redis() if request.param == "redis" else None
    clock = Clock()
    rl = Limiter(client, prefix, clock)
    yield rl, clock
    if client is not None:
        rl.loop.run_until_complete(client.aclose())
    rl.loop.close()
    sync = redis.Redis()
    for key in sync.scan_iter(f"{prefix}:*"):
        sync.delete(key)


def allowed(limiter: Limiter, tenant: Tenant, tokens: int = 1) -> bool:
    try:
        limiter.check(tenant, tokens)
        return True
    except GatewayError as e:
        assert e.status == 429 and int(e.headers["Retry-After"]) >= 1
        return False


def test_a_burst_then_the_steady_rate_and_no_window_boundary_doubling(limiter) -> None:
    rl, clock = limiter
    tenant = Tenant("noisy", None, requests_per_min=60)  # 1 per second, a burst of 10
    assert [allowed(rl, tenant) for _ in range(12)] == [True] * 10 + [False] * 2
    accepted = 0
    for _ in range(960):  # two minutes at 8 requests a second
        clock.now += 0.125
        accepted += allowed(rl, tenant)
    assert 118 <= accepted <= 121  # the configured rate, evenly: no extra minute's worth at any boundary


def test_tokens_per_minute_and_a_rejection_counts_nothing(limiter) -> None:
    rl, clock = limiter
    tenant = Tenant("t", None, requests_per_min=600, tokens_per_min=1000)
    assert allowed(rl, tenant, 900)
    assert not allowed(rl, tenant, 200)  # 1100 > 1000 from idle
    with pytest.raises(GatewayError, match="1000 tokens per minute; retry in"):
        rl.check(tenant, 200)
    assert allowed(rl, tenant, 100)  # the rejected ones took nothing
    clock.now += 30  # half a minute refills 500 tokens
    assert allowed(rl, tenant, 500) and not allowed(rl, tenant, 50)


def test_tenants_do_not_share_limits_and_unlimited_tenants_pass(limiter) -> None:
    rl, _ = limiter
    a, b = Tenant("a", None, requests_per_min=6), Tenant("b", None, requests_per_min=6)
    assert allowed(rl, a) and not allowed(rl, a)
    assert allowed(rl, b)
    assert all(allowed(rl, Tenant("free", None)) for _ in range(100))


def test_a_request_that_could_never_pass_is_400_not_429(limiter) -> None:
    rl, _ = limiter
    tenant = Tenant("t", None, tokens_per_min=100)
    with pytest.raises(GatewayError) as e:
        rl.check(tenant, 101)
    assert e.value.status == 400 and "more than tenant 't' may use in a minute (100)" in e.value.message
    assert allowed(rl, tenant, 100)  # and it took nothing


def test_a_rejected_request_still_counts_as_a_request(limiter) -> None:
    rl, _ = limiter
    tenant = Tenant("t", None, requests_per_min=6, tokens_per_min=100)  # a burst of one request
    with pytest.raises(GatewayError):
        rl.check(tenant, 101)  # refused for its tokens, but it was a request
    assert not allowed(rl, tenant, 1)


def test_what_a_request_did_not_use_is_given_back(limiter) -> None:
    rl, clock = limiter
    tenant = Tenant("t", None, tokens_per_min=1000)
    spend = rl.spend(tenant, 900)
    assert not allowed(rl, tenant, 200)
    rl.refund(spend, 100)  # it used 100 of its 900
    assert allowed(rl, tenant, 800) and not allowed(rl, tenant, 150)  # 100 + 800 taken: 100 left
    assert rl.refund(None, 0) is None  # a tenant without a token limit spends nothing


def test_a_refund_never_moves_the_limit_before_now(limiter) -> None:
    rl, clock = limiter
    tenant = Tenant("t", None, tokens_per_min=1000)
    spend = rl.spend(tenant, 500)
    clock.now += 60  # it refilled meanwhile
    rl.refund(spend, 0)
    rl.refund(spend, 0)  # given back twice: still never more than a full bucket
    assert allowed(rl, tenant, 1000) and not allowed(rl, tenant, 1)


def test_gateways_counting_alone_each_take_their_share() -> None:
    """Redis not reachable (nothing listens): each of two gateways counts half of every limit, so
    the two together hold it; a gateway still lets one request through from idle."""
    from cache.l2 import RedisConfig, connect
    from tests.redis_server import RedisServer

    dead = RedisServer().start()
    dead.stop()
    clock = Clock()
    loop = asyncio.new_event_loop()
    clients = [connect(RedisConfig(url=dead.url, timeout_s=0.2), is_async=True) for _ in range(2)]
    gateways = [RateLimiter(client, "lp", clock, num_replicas=2) for client in clients]

    def passes(gateway: RateLimiter, tenant: Tenant, tokens: int = 1) -> bool:
        try:
            loop.run_until_complete(gateway.check(tenant, tokens))
            return True
        except GatewayError as e:
            assert e.status == 429
            return False

    try:
        burst = Tenant("burst", None, requests_per_min=60)  # a burst of 10
        assert [sum(passes(g, burst) for _ in range(8)) for g in gateways] == [5, 5]
        accepted = 0
        for _ in range(480):  # a minute at 8 requests a second to each
            clock.now += 0.125
            accepted += sum(passes(g, burst) for g in gateways)
        assert 58 <= accepted <= 61  # the configured rate, over both
        tokens = Tenant("tokens", None, tokens_per_min=1000)
        assert [passes(g, tokens, 500) for g in gateways] == [True, True]
        assert not any(passes(g, tokens, 1) for g in gateways)
        spend = loop.run_until_complete(gateways[0].spend(Tenant("other", None, tokens_per_min=1000), 400))
        assert spend.is_local and spend.interval_s == 0.12  # a token of its share: twice the rate's
        small = Tenant("small", None, requests_per_min=6)  # a burst of one request: less than a share
        assert [passes(g, small) for g in gateways] == [True, True] and not passes(gateways[0], small)
    finally:
        for client in clients:
            loop.run_until_complete(client.aclose())
        loop.close()


def test_a_hung_redis_never_stalls_the_event_loop() -> None:
    import os
    import signal

    from cache.l2 import RedisConfig, connect
    from tests.redis_server import RedisServer

    server = RedisServer().start()
    os.kill(server.process.pid, signal.SIGSTOP)  # accepts connections, never answers
    try:
        client = connect(RedisConfig(url=server.url, timeout_s=0.3), is_async=True)
        limiter = RateLimiter(client, f"loraplex-test-{uuid.uuid4().hex}")
        tenant = Tenant("t", None, requests_per_min=60)

        async def run() -> tuple[int, float]:
            ticks = 0

            async def ticker() -> None:
                nonlocal ticks
                while True:
                    await asyncio.sleep(0.01)
                    ticks += 1

            beat = asyncio.create_task(ticker())
            started = asyncio.get_running_loop().time()
            await limiter.admit(tenant)  # waits for Redis' timeout, then counts here
            took = asyncio.get_running_loop().time() - started
            beat.cancel()
            await client.aclose()
            return ticks, took

        ticks, took = asyncio.run(run())
        assert took < 2.0 and ticks >= 10  # the loop kept running while the limiter waited
        assert asyncio.run(limiter.admit(tenant)) is None  # and next time it does not even ask Redis for a while
    finally:
        os.kill(server.process.pid, signal.SIGCONT)
        server.stop()
