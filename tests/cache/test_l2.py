"""The Redis tier against the real local Redis (own key prefix), and with Redis gone."""

from __future__ import annotations

import socket
import time
import uuid

import pytest

from cache.l2 import CircuitBreaker, RedisConfig, RedisTier, connect


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_breaker_opens_after_consecutive_failures_and_probes_after_cooldown() -> None:
    clock = FakeClock()
    breaker = CircuitBreaker(failures_to_open=2, cooldown_s=5.0, clock=clock)
    breaker.record_failure()
    assert breaker.allow() and not breaker.is_open
    breaker.record_failure()
    assert breaker.is_open and not breaker.allow()
    clock.now = 5.0
    assert breaker.allow()  # one probe
    assert not breaker.allow() and not breaker.allow()  # and only one, until it reports back
    breaker.record_failure()  # the probe failed: closed for another cool-down
    assert not breaker.allow()
    clock.now = 10.0
    breaker.record_success()
    assert not breaker.is_open and breaker.allow() and breaker.consecutive_failures == 0


@pytest.fixture
def tier():
    config = RedisConfig(key_prefix=f"loraplex-test-{uuid.uuid4().hex}", ttl_s=60, timeout_s=0.5)
    client = connect(config)
    try:
        client.ping()
    except Exception as e:  # the machine runs Redis; say so plainly if it does not
        pytest.fail(f"the local Redis at {config.url} is needed for this test: {e}")
    yield RedisTier(client, config)
    keys = list(client.scan_iter(f"{config.key_prefix}:*"))
    if keys:
        client.delete(*keys)


def test_round_trip_in_one_lookup_with_ttl(tier) -> None:
    assert tier.put_many({b"k1": b"v1", b"k2": b"\x00\xffv2"})
    assert tier.get_many([b"k1", b"missing", b"k2"]) == [b"v1", None, b"\x00\xffv2"]
    assert 0 < tier.client.ttl(tier.key(b"k1")) <= 60
    tier.delete(b"k1")
    assert tier.get_many([b"k1"]) == [None]
    assert not tier.is_degraded and tier.num_errors == 0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_redis_down_means_misses_fast_then_no_calls_until_cooldown() -> None:
    clock = FakeClock()
    config = RedisConfig(url=f"redis://127.0.0.1:{free_port()}/0", timeout_s=0.2, breaker_failures=2, breaker_cooldown_s=30)
    tier = RedisTier(connect(config), config, clock)
    started = time.perf_counter()
    assert tier.get_many([b"a", b"b"]) == [None, None]
    assert tier.put_many({b"a": b"1"}) is False
    assert tier.is_degraded and tier.num_errors == 2
    assert time.perf_counter() - started < 2.0  # nothing waits on a dead server beyond its timeout
    assert tier.get_many([b"a"]) == [None] and tier.num_errors == 2  # open: not even tried
    clock.now = 31.0
    tier.get_many([b"a"])  # the probe fails again
    assert tier.num_errors == 3 and tier.is_degraded


def test_caching_resumes_when_redis_returns(tier) -> None:
    clock = FakeClock()
    tier.breaker = CircuitBreaker(1, 5.0, clock)
    tier.breaker.record_failure()  # as if Redis had been down
    assert tier.is_degraded and tier.get_many([b"x"]) == [None]
    clock.now = 6.0
    assert tier.put_many({b"x": b"1"})  # the probe succeeds and closes the breaker
    assert not tier.is_degraded and tier.get_many([b"x"]) == [b"1"]
