"""Per-tenant rate limits: requests and tokens per minute (torch-free).

A token bucket in its GCRA form (one "theoretical arrival time" per tenant and
limit): requests flow at the configured rate, with a burst of 10 seconds' worth
(requests) or a minute's worth (tokens) from idle. Unlike fixed one-minute
windows, a tenant over its limit cannot send a minute's allowance at every
window boundary: the noisy tenant's accepted requests arrive evenly, so they
do not crowd out the others. A rejected request counts nothing.

Kept in Redis (one atomic script per check) so the limits hold across every
gateway replica; per process when Redis is not configured or not reachable. On a
Redis Cluster a tenant's keys carry its id as their hash tag, so one script's keys
share a slot; on one Redis they keep the names they had. A
limited request gets 429 with `Retry-After` (seconds until it would pass); one
that needs more tokens than a minute allows gets 400 (it never would).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from cache.l2 import RedisConfig, is_cluster
from gateway.api.protocol import APIError
from gateway.tenants import Tenant

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


@dataclass(frozen=True)
class _Limit:
    name: str
    interval_s: float  # one unit's share of the rate
    tolerance_s: float  # the burst, in time
    cost: float
    description: str


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
                 clock: Callable[[], float] = time.time) -> None:
        self.client, self.key_prefix, self._clock = client, key_prefix, clock
        self._script = client.register_script(_GCRA) if client is not None else None
        self._is_cluster = client is not None and is_cluster(client)
        self._local: dict[str, float] = {}
        self._lock = threading.Lock()
        self._redis_down_until = 0.0

    async def admit(self, tenant: Tenant) -> None:
        """Count one request against the tenant's request rate, or raise 429."""
        await self._check(tenant, _request_limit(tenant))

    async def spend(self, tenant: Tenant, num_tokens: int) -> None:
        """Count a request's tokens (prompt + most it may generate), or raise 429; 400 when one
        request needs more than a minute's worth (it could never pass)."""
        if tenant.tokens_per_min is not None and num_tokens > tenant.tokens_per_min:
            raise APIError(400, f"this request needs up to {num_tokens} tokens, more than tenant {tenant.id!r} "
                           f"may use in a minute ({tenant.tokens_per_min}): lower max_tokens or shorten the prompt",
                           "request_over_rate_limit")
        await self._check(tenant, _token_limit(tenant, num_tokens))

    async def check(self, tenant: Tenant, num_tokens: int) -> None:
        """A request and its tokens at once (tools and tests)."""
        await self.admit(tenant)
        await self.spend(tenant, num_tokens)

    async def _check(self, tenant: Tenant, limits: list[_Limit]) -> None:
        if not limits:
            return
        wait, which = await self._wait(tenant.id, limits, self._clock())
        if wait > 0:
            retry_after = str(max(1, math.ceil(wait)))
            raise APIError(429, f"rate limit exceeded for tenant {tenant.id!r}: {limits[which].description}; "
                           f"retry in {retry_after} s", "rate_limit_exceeded", {"Retry-After": retry_after})

    def _key(self, tenant_id: str, name: str) -> str:
        if self._is_cluster:  # the tenant's id is the hash tag: its limits share a slot, as one script needs
            return f"{self.key_prefix}:rl:{{{tenant_id}}}:{name}"
        return f"{self.key_prefix}:rl:{tenant_id}:{name}"

    async def _wait(self, tenant_id: str, limits: list[_Limit], now: float) -> tuple[float, int]:
        """(seconds until the request would pass, index of the limit that said no); (<= 0, _) counts it."""
        keys = [self._key(tenant_id, limit.name) for limit in limits]
        if self._script is not None and now >= self._redis_down_until:
            try:
                costs = [(limit.interval_s, limit.tolerance_s, limit.cost) for limit in limits]
                args = [repr(now)] + [repr(v) for cost in costs for v in cost]
                reply = await self._script(keys=keys, args=args)
                wait, which = (reply.decode() if isinstance(reply, bytes) else reply).split()
                return float(wait), max(int(which) - 1, 0)
            except Exception as e:  # noqa: BLE001 - any client error: count here for a while (logged)
                log.warning("rate limits: Redis unavailable (%s); counting per process for %.0f s", e, REDIS_RETRY_S)
                self._redis_down_until = now + REDIS_RETRY_S
        with self._lock:
            new, wait, which = [], 0.0, 0
            for i, (key, limit) in enumerate(zip(keys, limits)):
                tat = max(self._local.get(key, now), now) + limit.cost * limit.interval_s
                new.append(tat)
                if tat - limit.tolerance_s - now > wait:
                    wait, which = tat - limit.tolerance_s - now, i
            if wait <= 0:
                self._local.update(zip(keys, new))
            return wait, which
