"""The state store: where what must never be lost is kept, apart from the prefix cache (torch-free).

Accounts (run-time tenants, their keys, operator keys), usage and quotas, rate limits, stored
responses, the adapter registry and the operators' audit log live in the state store; the prefix
cache's KV lives in the cache's Redis (`cache.redis_url`), which may evict anything at any time.
A bill, a revocation or a registered adapter must not vanish because the cache filled up, so the
state store is its own Redis (or Redis Cluster) that never evicts (`maxmemory-policy noeviction`)
and keeps its data on disk (AOF), checked when a gateway starts (`check`): a store that may
evict or keeps nothing on disk is refused. `state.ephemeral: true` accepts one anyway (a laptop:
one Redis, one URL, state lost with it), and is the only way the state may share the cache's Redis.

`INFO` is read rather than `CONFIG GET`: managed Redis services often disable CONFIG.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

from cache.l2 import RedisConfig, client_errors, connect

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StateSettings:
    redis_url: str | None = None  # the state store; None: the cache's Redis, allowed only with ephemeral
    cluster: bool = False  # redis_url is a seed node of a Redis Cluster
    password_file: str | None = None  # a mounted Secret, read when connecting
    timeout_s: float = 1.0  # per connect, send and receive (state is worth a longer wait than the cache)
    ephemeral: bool = False  # accept a state store that may evict or forget (one machine, a laptop, tests)
    stale_after_s: float = 30.0  # how long a gateway that cannot read the store serves from its last read

    def __post_init__(self) -> None:
        if self.redis_url is not None:
            RedisConfig(self.redis_url, cluster=self.cluster)  # the URL's own checks
        if self.timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s}")
        if not 0 < self.stale_after_s <= 3600:
            raise ValueError(f"stale_after_s must be in (0, 3600], got {self.stale_after_s}")


class StateStoreRefused(RuntimeError):
    """The state store may lose what is kept there, and the config did not say that is accepted."""


def state_redis(settings: StateSettings, cache_redis: RedisConfig | None) -> RedisConfig | None:
    """The state store's Redis config (None: no Redis, files and memory on one machine). Its keys
    keep the cache's prefix, so one deployment's keys share one prefix wherever they live."""
    if settings.redis_url is None:
        return cache_redis
    prefix = cache_redis.key_prefix if cache_redis is not None else RedisConfig.key_prefix
    return RedisConfig(settings.redis_url, key_prefix=prefix, timeout_s=settings.timeout_s,
                       password_file=settings.password_file, cluster=settings.cluster)


def config_error(settings: StateSettings, cache_redis: RedisConfig | None) -> str | None:
    """Why a config's state settings cannot be used as they are (None: they can)."""
    if settings.ephemeral:
        return None
    if settings.redis_url is None:
        return ("state.redis_url is not set: tenants, keys, usage and the adapter registry would live in "
                + ("the cache's Redis, which may evict them" if cache_redis is not None else "this process and its files")
                + "; set state.redis_url to a Redis with maxmemory-policy noeviction and appendonly yes, "
                "or state.ephemeral: true to accept losing them (one machine)")
    if cache_redis is not None and cache_redis.url == settings.redis_url:
        return ("state.redis_url is the cache's Redis (cache.redis_url): the prefix cache's KV would fill the state "
                "store; give each its own Redis, or set state.ephemeral: true")
    return None


def _facts(info: dict) -> tuple[str, bool]:
    return str(info.get("maxmemory_policy", "?")), str(info.get("aof_enabled", "0")) == "1"


def durability_problems(infos: list[dict]) -> list[str]:
    """What makes the servers whose INFO these are unfit to keep state (each master of a cluster)."""
    problems = []
    for info in infos:
        policy, has_aof = _facts(info)
        where = info.get("_node", "the state store")
        if policy != "noeviction":
            problems.append(f"{where}: maxmemory-policy is {policy} (needs noeviction: it may evict state)")
        if not has_aof:
            problems.append(f"{where}: appendonly is off (needs appendonly yes: a restart would lose state)")
    return problems


async def check(settings: StateSettings, redis_config: RedisConfig | None, client=None) -> None:
    """StateStoreRefused unless the state store keeps what it is given (nothing to check when the
    config accepts an ephemeral store). An unreachable store is not refused here: requests that
    need it wait for it, bounded (gateway/tenancy/tenants.py)."""
    if settings.ephemeral or redis_config is None:
        if redis_config is not None or settings.ephemeral:
            log.warning("the state store is ephemeral (state.ephemeral: true): tenants, keys, usage and the registry "
                        "are lost with it")
        return
    own = client is None
    client = connect(redis_config, is_async=True) if own else client
    try:
        infos = await _server_infos(client, redis_config.cluster)
    except client_errors() as e:
        log.warning("the state store %s cannot be checked yet (%s)", redis_config.safe_url, type(e).__name__)
        raise
    finally:
        if own:
            await client.aclose()
    problems = durability_problems(infos)
    if problems:
        raise StateStoreRefused("the state store " + redis_config.safe_url + " would lose state: " + "; ".join(problems)
                                + " (or set state.ephemeral: true to accept that)")


def check_now(settings: StateSettings, redis_config: RedisConfig | None) -> str | None:
    """`check`, from outside an event loop (`loraplex serve` before it deploys): StateStoreRefused, or
    what to say when the store cannot be reached yet (the gateways check it before they first read it)."""
    try:
        asyncio.run(check(settings, redis_config))
    except client_errors() as e:
        return f"the state store cannot be reached yet ({type(e).__name__}); requests that need it wait for it"
    return None


async def _server_infos(client, is_cluster: bool) -> list[dict]:
    if not is_cluster:
        return [{**await client.info("memory"), **await client.info("persistence")}]
    await client.initialize()  # the slot map: which nodes are masters
    out = []
    for node in client.get_primaries():
        memory = await client.info("memory", target_nodes=node)
        persistence = await client.info("persistence", target_nodes=node)
        out.append({**memory, **persistence, "_node": f"{node.host}:{node.port}"})
    return out
