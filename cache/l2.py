"""The shared tier: Redis, kept off the critical path when it is down or slow (torch-free).

Every call has a socket timeout; failures feed a circuit breaker that stops
calling a dead server for a cool-down, then lets one call through to probe.
While it is open, lookups are misses and writes are dropped: requests still
succeed, uncached. The Redis client is a constructor argument.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RedisConfig:
    url: str = "redis://127.0.0.1:6379/0"  # rediss:// for TLS; a password goes in the URL
    key_prefix: str = "loraplex"
    ttl_s: int = 3600
    timeout_s: float = 0.05
    breaker_failures: int = 3  # consecutive failures that open the breaker
    breaker_cooldown_s: float = 5.0


class CircuitBreaker:
    def __init__(self, failures_to_open: int, cooldown_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.failures_to_open, self.cooldown_s, self._clock = failures_to_open, cooldown_s, clock
        self.consecutive_failures = 0
        self.opened_at: float | None = None

    @property
    def is_open(self) -> bool:
        return self.opened_at is not None

    def allow(self) -> bool:
        """Closed: yes. Open: only once the cool-down has passed (a probe)."""
        return self.opened_at is None or self._clock() - self.opened_at >= self.cooldown_s

    def record_success(self) -> None:
        self.consecutive_failures, self.opened_at = 0, None

    def record_failure(self) -> None:
        self.consecutive_failures += 1
        if self.consecutive_failures >= self.failures_to_open or self.opened_at is not None:
            self.opened_at = self._clock()  # (re)open; a failed probe restarts the cool-down


def connect(config: RedisConfig):
    import redis  # only the shared tier needs the client library

    return redis.Redis.from_url(config.url, socket_timeout=config.timeout_s, socket_connect_timeout=config.timeout_s)


class RedisTier:
    def __init__(self, client, config: RedisConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self.client, self.config = client, config
        self.breaker = CircuitBreaker(config.breaker_failures, config.breaker_cooldown_s, clock)
        self.num_errors = 0

    @property
    def is_degraded(self) -> bool:
        return self.breaker.is_open

    def key(self, key: bytes) -> str:
        return f"{self.config.key_prefix}:kv:{key.hex()}"

    def _call(self, action: Callable[[], object]) -> object | None:
        if not self.breaker.allow():
            return None
        try:
            result = action()
        except Exception as e:  # any client error (timeout, refused, reset): a miss, counted
            self.num_errors += 1
            self.breaker.record_failure()
            log.warning("redis unavailable (%s: %s); continuing uncached", type(e).__name__, e)
            return None
        self.breaker.record_success()
        return result

    def get_many(self, keys: Sequence[bytes]) -> list[bytes | None]:
        """One round trip (MGET); all misses when Redis is unavailable."""
        if not keys:
            return []
        values = self._call(lambda: self.client.mget([self.key(k) for k in keys]))
        return list(values) if values is not None else [None] * len(keys)

    def put_many(self, items: Mapping[bytes, bytes]) -> bool:
        if not items:
            return True

        def write() -> bool:
            pipe = self.client.pipeline(transaction=False)
            for key, value in items.items():
                pipe.set(self.key(key), value, ex=self.config.ttl_s)
            pipe.execute()
            return True

        return self._call(write) is not None

    def delete(self, key: bytes) -> None:
        self._call(lambda: self.client.delete(self.key(key)))
