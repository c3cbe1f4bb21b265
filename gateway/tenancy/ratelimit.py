"""Per-tenant rate limits: requests and tokens per minute (torch-free).

A token bucket in its GCRA form (one "theoretical arrival time" per tenant and
limit): requests flow at the configured rate, with a burst of 10 seconds' worth
(requests) or a minute's worth (tokens) from idle. Unlike fixed one-minute
windows, a tenant over its limit cannot send a minute's allowance at every
window boundary: the noisy tenant's accepted requests arrive evenly, so they
do not crowd out the others. A rejected request counts nothing.

A request's tokens are taken at admission as the most it may use (prompt + n x
max_tokens) and settled when it ends: what it did not use is given back (its
limit's arrival time moved back by unused x interval, never before now), so the
limit counts what tenants used, not what they asked for.

Kept in Redis (one atomic script per check or refund) so the limits hold across
every gateway replica. When Redis is not configured or not reachable, each
process counts alone, each limit divided by the number of gateway replicas
(`num_replicas`: the rate and the burst), so the sum over the gateways still
holds the limit; the one exception is that a gateway lets one request through
from idle even when it is larger than its share of the burst. On a Redis Cluster
a tenant's keys carry its id as their hash tag, so one script's keys share a
slot; on one Redis they keep the names they had. A limited request gets 429
with `Retry-After` (seconds until it would pass); one that needs more tokens
than a minute allows gets 400 (it never would).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from cache.l2 import RedisConfig, is_cluster
from gateway.errors import GatewayError
from gateway.tenancy.tenants import Tenant

log = logging.getLogger(__name__)
REDIS_RETRY_S = 15.0

# KEYS: tat keys; ARGV: now, then (interval_s, tolerance_s, cost) per key. All or nothing.
# Returns "wait_s index": index (1-based) of the limit that said no, 0 when allowed.
_GCRA = """
local now = tonumber(ARGV[1])
local new = {}
local wait, which = 0, 0
for i, key in ipairs(KEYS) do
  local interval = tonumber(ARGV[3 * i - 1])
  local tolerance = tonumber(ARGV[3 * i])
  local cost = tonumber(ARGV[3 * i + 1])
  local tat = tonumber(redis.call('GET', key) or now)
  if tat < now then tat = now end
  new[i] = tat + cost * interval
  local early = new[i] - tolerance - now
  if early > wait then wait, which = early, i end
end
if wait > 0 then return tostring(wait) .. ' ' .. which end
for i, key in ipairs(KEYS) do
  redis.call('SET', key, tostring(new[i]), 'PX', math.ceil((new[i] - now) * 1000) + 1000)
end
return '0 0'
"""

# KEYS: a tat key; ARGV: now, seconds to give back. The time moves back, never before now.
_REFUND = """
local now = tonumber(ARGV[1])
local tat = tonumber(redis.call('GET', KEYS[1]) or now)
local new = math.max(tat - tonumber(ARGV[2]), now)
if new >= tat then return 0 end
if new > now then
  redis.call('SET', KEYS[1], tostring(new), 'PX', math.ceil((new - now) * 1000) + 1000)
else
  redis.call('DEL', KEYS[1])
end
return 1
"""


@dataclass(frozen=True)
class _Limit:
    name: str
    interval_s: float  # one unit's share of the rate
    tolerance_s: float  # the burst, in time
    cost: float
    description: str


@dataclass(frozen=True)
class TokenSpend:
    """The tokens a request took of its tenant's per-minute limit, where they were counted: what it
    does not use is given back there."""

    tenant_id: str
    num_tokens: int
    interval_s: float  # one token's share of the rate where it was counted
    is_local: bool  # counted in this process (Redis down), not in Redis


def _request_limit(tenant: Tenant) -> list[_Limit]:
    if tenant.requests_per_min is None:
        return []
    interval = 60.0 / tenant.requests_per_min
    burst = max(1, math.ceil(tenant.requests_per_min / 6))
    return [_Limit("requests", interval, burst * interval, 1.0, f"{tenant.requests_per_min} requests per minute")]


def _token_limit(tenant: Tenant, num_tokens: int) -> list[_Limit]:
    if tenant.tokens_per_min is None:
        return []
    interval = 60.0 / tenant.tokens_per_min
    return [_Limit("tokens", interval, tenant.tokens_per_min * interval, float(num_tokens),
                   f"{tenant.tokens_per_min} tokens per minute")]


class RateLimiter:
    """A tenant's requests are counted when they arrive (`admit`, before any parsing, so a
    rejected request counts too) and their tokens once known (`spend`). The Redis client
    is an asyncio one (redis.asyncio): a slow Redis never blocks the event loop."""

    def __init__(self, client=None, key_prefix: str = RedisConfig.key_prefix,
                 clock: Callable[[], float] = time.time, num_replicas: int = 1) -> None:
        self.client, self.key_prefix, self._clock = client, key_prefix, clock
        self.num_replicas = num_replicas  # gateways counting alone while Redis is down each take this share
        self._script = client.register_script(_GCRA) if client is not None else None
        self._refund = client.register_script(_REFUND) if client is not None else None
        self._is_cluster = client is not None and is_cluster(client)
        self._local: dict[str, float] = {}
        self._lock = threading.Lock()
        self._redis_down_until = 0.0

    async def admit(self, tenant: Tenant) -> None:
        """Count one request against the tenant's request rate, or raise 429."""
        await self._check(tenant, _request_limit(tenant))

    async def spend(self, tenant: Tenant, num_tokens: int) -> TokenSpend | None:
        """Count a request's tokens (prompt + most it may generate), or raise 429; 400 when one
        request needs more than a minute's worth (it could never pass). None: the tenant has no
        token limit."""
        if tenant.tokens_per_min is not None and num_tokens > tenant.tokens_per_min:
            raise GatewayError(400, f"this request needs up to {num_tokens} tokens, more than tenant {tenant.id!r} "
                           f"may use in a minute ({tenant.tokens_per_min}): lower max_tokens or shorten the prompt",
                           "request_over_rate_limit")
        limits = _token_limit(tenant, num_tokens)
        if not limits:
            return None
        is_local = await self._check(tenant, limits)
        return TokenSpend(tenant.id, num_tokens, limits[0].interval_s * (self.num_replicas if is_local else 1), is_local)

    async def refund(self, spend: TokenSpend | None, num_used: int) -> None:
        """Give back what a request took and did not use (its end), where it was counted. A refund
        Redis cannot take is left undone: the limit errs on the strict side."""
        if spend is None or num_used >= spend.num_tokens:
            return
        now, back_s = self._clock(), (spend.num_tokens - max(num_used, 0)) * spend.interval_s
        key = self._key(spend.tenant_id, "tokens")
        if not spend.is_local:
            if now < self._redis_down_until:
                return  # known down: not waited for
            try:
                await self._refund(keys=[key], args=[repr(now), repr(back_s)])
            except Exception as e:  # noqa: BLE001 - any client error: the tokens come back within a minute anyway
                log.warning("rate limits: a refund of %s's tokens not given (%s)", spend.tenant_id, e)
            return
        with self._lock:
            if key in self._local:
                self._local[key] = max(self._local[key] - back_s, now)

    async def check(self, tenant: Tenant, num_tokens: int) -> None:
        """A request and its tokens at once (tools and tests)."""
        await self.admit(tenant)
        await self.spend(tenant, num_tokens)

    async def _check(self, tenant: Tenant, limits: list[_Limit]) -> bool:
        """Counted (True: in this process, Redis being down), or 429."""
        if not limits:
            return False
        wait, which, is_local = await self._wait(tenant.id, limits, self._clock())
        if wait > 0:
            retry_after = str(max(1, math.ceil(wait)))
            raise GatewayError(429, f"rate limit exceeded for tenant {tenant.id!r}: {limits[which].description}; "
                           f"retry in {retry_after} s", "rate_limit_exceeded", {"Retry-After": retry_after})
        return is_local

    def _key(self, tenant_id: str, name: str) -> str:
        if self._is_cluster:  # the tenant's id is the hash tag: its limits share a slot, as one script needs
            return f"{self.key_prefix}:rl:{{{tenant_id}}}:{name}"
        return f"{self.key_prefix}:rl:{tenant_id}:{name}"

    async def _wait(self, tenant_id: str, limits: list[_Limit], now: float) -> tuple[float, int, bool]:
        """(seconds until the request would pass, index of the limit that said no, whether it was
        counted in this process); (<= 0, _, _) counts it. In this process each limit is this
        gateway's share: its rate and burst over `num_replicas`, the burst at least one request."""
        keys = [self._key(tenant_id, limit.name) for limit in limits]
        if self._script is not None and now >= self._redis_down_until:
            try:
                costs = [(limit.interval_s, limit.tolerance_s, limit.cost) for limit in limits]
                args = [repr(now)] + [repr(v) for cost in costs for v in cost]
                reply = await self._script(keys=keys, args=args)
                wait, which = (reply.decode() if isinstance(reply, bytes) else reply).split()
                return float(wait), max(int(which) - 1, 0), False
            except Exception as e:  # noqa: BLE001 - any client error: count here for a while (logged)
                log.warning("rate limits: Redis unavailable (%s); counting per process for %.0f s", e, REDIS_RETRY_S)
                self._redis_down_until = now + REDIS_RETRY_S
        with self._lock:
            new, wait, which = [], 0.0, 0
            for i, (key, limit) in enumerate(zip(keys, limits)):
                interval_s = limit.interval_s * self.num_replicas
                tolerance_s = max(limit.tolerance_s, limit.cost * interval_s)
                tat = max(self._local.get(key, now), now) + limit.cost * interval_s
                new.append(tat)
                if tat - tolerance_s - now > wait:
                    wait, which = tat - tolerance_s - now, i
            if wait <= 0:
                self._local.update(zip(keys, new))
            return wait, which, True


def open_rate_limiter(redis_config: RedisConfig | None, num_replicas: int = 1) -> RateLimiter:
    """Rate limits in the state store's Redis (an asyncio client), or per process without one; an
    unreachable Redis is found on first use (limits then count per process, `num_replicas` sharing each)."""
    if redis_config is None:
        return RateLimiter(num_replicas=num_replicas)
    from cache.l2 import connect

    return RateLimiter(connect(redis_config, is_async=True), redis_config.key_prefix, num_replicas=num_replicas)
