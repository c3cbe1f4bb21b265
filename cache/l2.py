"""The shared tier: Redis, kept off the critical path when it is down or slow (torch-free).

Every call has a socket timeout; failures feed a circuit breaker that stops
calling a dead server for a cool-down, then lets one call through to probe.
While it is open, lookups are misses and writes are dropped: requests still
succeed, uncached. The Redis client is a constructor argument.

With `cluster` the URL is a seed node of a Redis Cluster. Chunk keys carry no
hash tag, so they spread over every slot and master; a call sends one pipeline
to each master that owns some of its keys (an MGET per slot: a multi-key
command's keys must share one). A failed call is a miss like any other, and it
makes the client ask the cluster for its slot map again, so after a failover
the next call goes to the new master: the tier recovers by itself. (redis-py's
own cluster pipeline would instead retry each failed command alone, each up to
a timeout: with a hung master, one lookup could wait a timeout per slot.)
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from cache.keys import redis_key

log = logging.getLogger(__name__)
CLUSTER_RETRIES = 1  # a cluster client's retries after a connection error or CLUSTERDOWN, each on a refreshed slot map


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
    cluster: bool = False  # `url` is a seed node of a Redis Cluster (the client learns the other nodes from it)

    def __post_init__(self) -> None:
        if not self.url.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError(f"redis url must start with redis://, rediss:// or unix://, got {self.url!r}")
        if not self.key_prefix or any(c.isspace() for c in self.key_prefix):
            raise ValueError(f"key_prefix must be a non-empty word, got {self.key_prefix!r}")
        if self.cluster:
            if not self.url.startswith(("redis://", "rediss://")):
                raise ValueError(f"a Redis Cluster's url must be a seed node's redis:// or rediss:// URL, got {self.safe_url!r}")
            if urlsplit(self.url).path not in ("", "/", "/0"):
                raise ValueError(f"a Redis Cluster has only database 0, the url names another: {self.safe_url!r}")
            if "{" in self.key_prefix or "}" in self.key_prefix:
                raise ValueError(f"key_prefix {self.key_prefix!r} holds a brace: in a Redis Cluster it would be the hash tag "
                                 "of every key, putting them all in one slot")
        if self.ttl_s < 1:
            raise ValueError(f"ttl_s must be >= 1, got {self.ttl_s}")
        if self.timeout_s <= 0 or self.breaker_cooldown_s < 0 or self.breaker_failures < 1:
            raise ValueError("timeout_s must be > 0, breaker_cooldown_s >= 0 and breaker_failures >= 1")

    @property
    def replica_ack_timeout_s(self) -> float:
        """How long a registry commit waits for a replica's acknowledgement (WAIT): half the timeout, so
        the WAIT's answer still comes within the socket timeout."""
        return self.timeout_s / 2

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
    """A client with the config's timeouts and credentials (redis.asyncio's with `is_async`); a Redis
    Cluster's client with `config.cluster`. The synchronous cluster client asks the seed node for the
    cluster's slots as it is made, so making it fails while the cluster is unreachable."""
    import redis  # only the shared tier needs the client library
    import redis.asyncio
    import redis.asyncio.retry
    import redis.cluster
    import redis.retry
    from redis.backoff import NoBackoff

    options: dict[str, object] = {"socket_timeout": config.timeout_s, "socket_connect_timeout": config.timeout_s}
    password = read_password_file(config.password_file) if config.password_file is not None else config.password
    if password is not None:
        options["password"] = password
    if config.tls_ca_file is not None:
        options["ssl_ca_certs"] = config.tls_ca_file
    if config.cluster:
        # a bounded number of immediate retries (redis-py's default backs off for seconds between them)
        options["retry"] = (redis.asyncio.retry.Retry if is_async else redis.retry.Retry)(NoBackoff(), CLUSTER_RETRIES)
        return (_seeded_async_cluster() if is_async else redis.cluster.RedisCluster).from_url(config.url, **options)
    return (redis.asyncio.Redis if is_async else redis.Redis).from_url(config.url, **options)


@functools.cache
def _seeded_async_cluster() -> type:
    """redis.asyncio's RedisCluster, keeping the URL's node among those it rediscovers the cluster from.

    Before 7.2, redis-py drops a node from those at each connection error and adds nodes back only
    when a rediscovery succeeds; errors on several nodes at once (a master killed while requests run
    on the others: the client closes every connection) can drop them all, and the client never
    connects again: "Redis Cluster cannot be connected ... reachable node: None" (redis/redis-py#3693,
    fixed by #3917 in 7.2). The test of a failover hits it about every other run without this."""
    from redis.asyncio.cluster import ClusterNode, RedisCluster

    class SeededRedisCluster(RedisCluster):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.seeds = {name: (node.host, node.port) for name, node in self.nodes_manager.startup_nodes.items()}

        async def initialize(self) -> RedisCluster:
            if self._initialize:  # about to rediscover the cluster
                startup_nodes = self.nodes_manager.startup_nodes
                for name, (host, port) in self.seeds.items():
                    if name not in startup_nodes:
                        startup_nodes[name] = ClusterNode(host, port, **self.connection_kwargs)
            return await super().initialize()

    return SeededRedisCluster


def is_cluster(client: object) -> bool:
    """Whether `client` is redis-py's Redis Cluster client (either kind): keys used together then need one hash tag."""
    import redis.asyncio.cluster
    import redis.cluster

    return isinstance(client, (redis.cluster.RedisCluster, redis.asyncio.cluster.RedisCluster))


def client_errors() -> tuple[type[Exception], ...]:
    """What a client raises while its server, or a cluster's slot map, is unreachable or in flux (a
    cluster client's own RedisClusterException is no RedisError)."""
    from redis.exceptions import RedisClusterException, RedisError

    return (RedisError, RedisClusterException, OSError)


class RedisTier:
    """`client` None: one made from `config` at first use (so a cluster that cannot be reached yet is a
    Redis failure like any other, not a worker that cannot start)."""

    def __init__(self, client, config: RedisConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self._client, self.config = client, config
        self._connect_lock = threading.Lock()
        self.breaker = CircuitBreaker(config.breaker_failures, config.breaker_cooldown_s, clock)
        self.num_errors = 0
        self.num_round_trips = 0
        self.num_recoveries = 0  # times the breaker closed again: Redis may have lost data meanwhile
        self._lock = threading.Lock()  # lookups and the background writer share the breaker

    @property
    def client(self) -> Any:
        with self._connect_lock:
            if self._client is None:
                self._client = connect(self.config)
            return self._client

    @property
    def is_degraded(self) -> bool:
        return self.breaker.is_open

    def key(self, key: bytes) -> str:
        return redis_key(self.config.key_prefix, key)

    def _by_master(self, client, names: Sequence[str]) -> list[tuple[Any, list[list[str]]]]:
        """(a client of one master, its names in groups that may share a multi-key command) for every master
        that owns some of `names`: one Redis owns them all; in a cluster, one group per slot."""
        if not self.config.cluster:
            return [(client, [list(names)])]
        from redis.cluster import key_slot

        by_node: dict[str, tuple[Any, dict[int, list[str]]]] = {}
        for name in names:
            node = client.get_node_from_key(name)
            by_node.setdefault(node.name, (node, {}))[1].setdefault(key_slot(name.encode()), []).append(name)
        return [(client.get_redis_connection(node), list(slots.values())) for node, slots in by_node.values()]

    def _refresh_slot_map(self) -> None:
        """After a failed call on a cluster: ask it where the slots are now (a failover moves them). A client
        that cannot find the cluster at all is dropped, and the next call makes one from the URL again (the
        nodes it knew may all be gone, or have new addresses)."""
        with self._connect_lock:
            if self._client is None:
                return
            try:
                self._client.nodes_manager.initialize()
            except client_errors() as e:
                log.warning("redis cluster: cannot refresh the slot map (%s: %s); reconnecting from %s at the next call",
                            type(e).__name__, e, self.config.safe_url)
                self._client = None  # not closed: another thread may still be using it (its sockets close with it)

    def _call(self, action: Callable[[Any], object]) -> object | None:
        with self._lock:
            if not self.breaker.allow():
                return None
            self.num_round_trips += 1
        try:
            result = action(self.client)
        except Exception as e:  # noqa: BLE001 - any client error (timeout, refused, reset): a miss, counted
            with self._lock:
                self.num_errors += 1
                self.breaker.record_failure()
            log.warning("redis unavailable (%s: %s); continuing uncached", type(e).__name__, e)
            if self.config.cluster:
                self._refresh_slot_map()
            return None
        with self._lock:
            self.num_recoveries += self.breaker.is_open
            self.breaker.record_success()
        return result

    def get_many(self, keys: Sequence[bytes]) -> list[bytes | None]:
        """One round trip (an MGET; on a cluster, one pipeline of an MGET per slot to each master); all
        misses when Redis is unavailable."""
        if not keys:
            return []
        names = [self.key(k) for k in keys]

        def read(client) -> list[bytes | None]:
            found: dict[str, bytes | None] = {}
            for master, groups in self._by_master(client, names):
                pipe = master.pipeline(transaction=False)
                for group in groups:
                    pipe.mget(group)
                for group, values in zip(groups, pipe.execute()):
                    found.update(zip(group, values))
            return [found[name] for name in names]

        values = self._call(read)
        return values if values is not None else [None] * len(keys)

    def put_many(self, items: Mapping[bytes, bytes]) -> bool:
        """One pipeline of SETs (to each master, on a cluster)."""
        if not items:
            return True
        values = {self.key(key): value for key, value in items.items()}

        def write(client) -> bool:
            for master, groups in self._by_master(client, list(values)):
                pipe = master.pipeline(transaction=False)
                for name in (name for group in groups for name in group):
                    pipe.set(name, values[name], ex=self.config.ttl_s)
                pipe.execute()
            return True

        return self._call(write) is not None

    def delete_many(self, keys: Sequence[bytes]) -> None:
        if not keys:
            return

        def delete(client) -> None:
            for master, groups in self._by_master(client, [self.key(k) for k in keys]):
                pipe = master.pipeline(transaction=False)
                for group in groups:
                    pipe.delete(*group)
                pipe.execute()

        self._call(delete)

    def delete(self, key: bytes) -> None:
        self.delete_many([key])
