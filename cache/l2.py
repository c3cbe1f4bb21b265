"""The shared tier: Redis, kept off the critical path when it is down or slow (torch-free).

Every call has a socket timeout; failures feed a circuit breaker that stops
calling a dead server for a cool-down, then lets one call through to probe.
While it is open, lookups are misses and writes are dropped: requests still
succeed, uncached. The Redis client is a constructor argument.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from cache.keys import redis_key

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RedisConfig:
    url: str = "redis://127.0.0.1:6379/0"  # rediss:// for TLS; redis://:PASSWORD@host:port/db
    key_prefix: str = "loraplex"
    ttl_s: int = 3600
    timeout_s: float = 0.25  # per connect, send and receive: nothing waits on Redis longer
    breaker_failures: int = 3  # consecutive failures that open the breaker
    breaker_cooldown_s: float = 5.0
    password: str | None = None  # overrides the URL's
    password_file: str | None = None  # a mounted Secret (Kubernetes), read when connecting; overrides both
    tls_ca_file: str | None = None  # CA bundle for rediss:// servers with a private CA

    def __post_init__(self) -> None:
        if not self.url.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError(f"redis url must start with redis://, rediss:// or unix://, got {self.url!r}")
        if not self.key_prefix or any(c.isspace() for c in self.key_prefix):
            raise ValueError(f"key_prefix must be a non-empty word, got {self.key_prefix!r}")
        if self.ttl_s < 1:
            raise ValueError(f"ttl_s must be >= 1, got {self.ttl_s}")
        if self.timeout_s <= 0 or self.breaker_cooldown_s < 0 or self.breaker_failures < 1:
            raise ValueError("timeout_s must be > 0, breaker_cooldown_s >= 0 and breaker_failures >= 1")

    @property
    def safe_url(self) -> str:
        """The URL without its password, for logs and health output."""
        scheme, sep, rest = self.url.partition("://")
        _credentials, at, host = rest.rpartition("@")
        return f"{scheme}{sep}{'***@' if at else ''}{host}"


class CircuitBreaker:
    def __init__(self, failures_to_open: int, cooldown_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.failures_to_open, self.cooldown_s, self._clock = failures_to_open, cooldown_s, clock
        self.consecutive_failures = 0
        self.opened_at: float | None = None
        self.is_probing = False  # open, and one caller is trying Redis again

    @property
    def is_open(self) -> bool:
        return self.opened_at is not None

    def allow(self) -> bool:
        """Closed: yes. Open: once the cool-down has passed, one caller (the probe) until it
        reports back; every other caller meanwhile: no."""
        if self.opened_at is None:
            return True
        if self.is_probing or self._clock() - self.opened_at < self.cooldown_s:
            return False
        self.is_probing = True
        return True

    def record_success(self) -> None:
        self.consecutive_failures, self.opened_at, self.is_probing = 0, None, False

    def record_failure(self) -> None:
        self.consecutive_failures += 1
        if self.consecutive_failures >= self.failures_to_open or self.opened_at is not None:
            self.opened_at = self._clock()  # (re)open; a failed probe restarts the cool-down
        self.is_probing = False


def read_password_file(path: str) -> str:
    try:
        return Path(path).read_text(encoding="utf-8").strip()
    except OSError as e:
        raise ValueError(f"redis password file {path}: cannot read it: {e.strerror or e}") from e


def connect(config: RedisConfig, *, is_async: bool = False):
    """A client with the config's timeouts and credentials (redis.asyncio's with `is_async`)."""
    import redis  # only the shared tier needs the client library
    import redis.asyncio

    options: dict[str, object] = {"socket_timeout": config.timeout_s, "socket_connect_timeout": config.timeout_s}
    password = read_password_file(config.password_file) if config.password_file is not None else config.password
    if password is not None:
        options["password"] = password
    if config.tls_ca_file is not None:
        options["ssl_ca_certs"] = config.tls_ca_file
    return (redis.asyncio.Redis if is_async else redis.Redis).from_url(config.url, **options)


class RedisTier:
    def __init__(self, client, config: RedisConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self.client, self.config = client, config
        self.breaker = CircuitBreaker(config.breaker_failures, config.breaker_cooldown_s, clock)
        self.num_errors = 0
        self.num_round_trips = 0
        self.num_recoveries = 0  # times the breaker closed again: Redis may have lost data meanwhile
        self._lock = threading.Lock()  # lookups and the background writer share the breaker

    @property
    def is_degraded(self) -> bool:
        return self.breaker.is_open

    def key(self, key: bytes) -> str:
        return redis_key(self.config.key_prefix, key)

    def _call(self, action: Callable[[], object]) -> object | None:
        with self._lock:
            if not self.breaker.allow():
                return None
            self.num_round_trips += 1
        try:
            result = action()
        except Exception as e:  # noqa: BLE001 - any client error (timeout, refused, reset): a miss, counted
            with self._lock:
                self.num_errors += 1
                self.breaker.record_failure()
            log.warning("redis unavailable (%s: %s); continuing uncached", type(e).__name__, e)
            return None
        with self._lock:
            self.num_recoveries += self.breaker.is_open
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

    def delete_many(self, keys: Sequence[bytes]) -> None:
        if keys:
            self._call(lambda: self.client.delete(*(self.key(k) for k in keys)))

    def delete(self, key: bytes) -> None:
        self.delete_many([key])
