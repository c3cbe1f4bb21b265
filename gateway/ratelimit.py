"""Per-tenant rate limits: requests and tokens per minute (torch-free).

Counted in Redis (one pipelined round trip per request: INCR, INCRBY, EXPIRE)
so the limits hold across every gateway replica; per process when Redis is
not configured or not reachable. Fixed one-minute windows; a rejected request
does not count. A limited request gets 429 with `Retry-After` (seconds to the
next window).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable

from gateway.protocol import APIError
from gateway.tenants import Tenant

log = logging.getLogger(__name__)
WINDOW_S = 60


class RateLimiter:
    def __init__(self, client=None, key_prefix: str = "loraplex", clock: Callable[[], float] = time.time) -> None:
        self.client, self.key_prefix, self._clock = client, key_prefix, clock
        self._local: dict[tuple[str, int], list[int]] = {}
        self._lock = threading.Lock()
        self._redis_down_until = 0.0

    def check(self, tenant: Tenant, num_tokens: int) -> None:
        """Count this request against the tenant's limits, or raise 429 (counting nothing)."""
        if tenant.requests_per_min is None and tenant.tokens_per_min is None:
            return
        now = self._clock()
        window = int(now // WINDOW_S)
        retry_after = str(max(1, math.ceil(WINDOW_S - now % WINDOW_S)))
        requests, tokens = self._count(tenant.id, window, 1, num_tokens)
        over = None
        if tenant.requests_per_min is not None and requests > tenant.requests_per_min:
            over = f"{tenant.requests_per_min} requests per minute"
        elif tenant.tokens_per_min is not None and tokens > tenant.tokens_per_min:
            over = f"{tenant.tokens_per_min} tokens per minute"
        if over is not None:
            self._count(tenant.id, window, -1, -num_tokens)
            raise APIError(429, f"rate limit exceeded for tenant {tenant.id!r}: {over}; retry in {retry_after} s", "rate_limit_exceeded",
                           {"Retry-After": retry_after})

    def _count(self, tenant_id: str, window: int, num_requests: int, num_tokens: int) -> tuple[int, int]:
        if self.client is not None and self._clock() >= self._redis_down_until:
            key = f"{self.key_prefix}:rl:{tenant_id}:{window}"
            try:
                pipe = self.client.pipeline(transaction=True)
                pipe.hincrby(key, "requests", num_requests)
                pipe.hincrby(key, "tokens", num_tokens)
                pipe.expire(key, 2 * WINDOW_S)
                requests, tokens, _ = pipe.execute()
                return int(requests), int(tokens)
            except Exception as e:  # any client error: count here for a while
                log.warning("rate limits: Redis unavailable (%s); counting per process for %d s", e, WINDOW_S // 4)
                self._redis_down_until = self._clock() + WINDOW_S / 4
        with self._lock:
            counts = self._local.setdefault((tenant_id, window), [0, 0])
            counts[0] += num_requests
            counts[1] += num_tokens
            for old in [k for k in self._local if k[1] < window]:
                del self._local[old]
            return counts[0], counts[1]
