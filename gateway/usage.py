"""Usage a bill can be built on (torch-free): per tenant, key, adapter set, model and UTC hour,
the requests, prompt tokens, cached prompt tokens, generated tokens, and the requests by how they
finished; and the tenants' token quotas per UTC day and month, enforced from the same counts.

Each answered request is counted once, by the gateway that answered it, when it ends (a
failover retry inside the gateway is one request; a stream the client cancelled counts what was
sent), and is written before its answer ends: an answer the client got is counted, across a
gateway restart. Kept in Redis under the deployment's key prefix: one hash per tenant and hour
(fields `key|adapter|model|count`), a day and a month total per tenant for the quotas, all of
one tenant in one Redis Cluster slot (a hash tag), and written by one script that first sets
the request's marker: a write sent again (the reply was lost) counts nothing twice. Redis
down: the counts wait in memory (bounded) and are written when it is back. Without Redis they
are kept in memory only (one process; lost on restart).

Quotas count prompt and generated tokens. A request is refused (429, saying which quota and when
it resets) when the period's count so far, plus its prompt, is over the quota; the count is read
at most QUOTA_CACHE_S stale, plus what this gateway counted since, so several gateways may let a
tenant overshoot by what they admit within that time.
"""

from __future__ import annotations

import asyncio
import calendar
import logging
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import UTC, datetime

from cache.l2 import client_errors, is_cluster

log = logging.getLogger(__name__)
COUNTS = ("requests", "prompt_tokens", "cached_tokens", "completion_tokens")
FINISH_REASONS = ("stop", "length", "tool_calls", "cancelled", "error")
MARKER_TTL_S = 2 * 24 * 3600
RETENTION_S = 400 * 24 * 3600  # hourly counts are kept this long (a bill's period, and disputes)
MAX_PENDING = 100_000  # counts waiting for Redis; past it the oldest are dropped (and logged)
QUOTA_CACHE_S = 1.0
RETRY_S = 1.0
MAX_QUERY_HOURS = 93 * 24

# KEYS: marker, hour hash, day hash, month hash, tenants set; ARGV: marker ttl, retention, tokens, then field/count pairs
_RECORD = """
if not redis.call('SET', KEYS[1], '1', 'NX', 'EX', ARGV[1]) then return 0 end
for i = 4, #ARGV, 2 do redis.call('HINCRBY', KEYS[2], ARGV[i], ARGV[i + 1]) end
redis.call('EXPIRE', KEYS[2], ARGV[2])
for _, key in ipairs({KEYS[3], KEYS[4]}) do
  redis.call('HINCRBY', key, 'tokens', ARGV[3])
  redis.call('HINCRBY', key, 'requests', 1)
  redis.call('EXPIRE', key, ARGV[2])
end
return 1
"""


@dataclass(frozen=True)
class UsageEvent:
    """One answered request's usage."""

    request_id: str
    tenant: str
    key_id: str
    adapter: str  # the adapters it used, as its tenant named them ("base": none)
    model: str
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    finish_reason: str  # stop, length, tool_calls, cancelled, error
    at_s: float  # wall-clock time it ended

    @property
    def tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    def counts(self) -> dict[str, int]:
        finish = self.finish_reason if self.finish_reason in FINISH_REASONS else "stop"
        return {"requests": 1, "prompt_tokens": self.prompt_tokens, "cached_tokens": self.cached_tokens,
                "completion_tokens": self.completion_tokens, f"finish_{finish}": 1}


def hour_of(at_s: float) -> str:
    return time.strftime("%Y%m%d%H", time.gmtime(at_s))


def period_end_s(period: str, at_s: float) -> float:
    """When the UTC day or month holding `at_s` ends (its quota resets)."""
    t = time.gmtime(at_s)
    if period == "day":
        return calendar.timegm((t.tm_year, t.tm_mon, t.tm_mday, 0, 0, 0)) + 86400.0
    year, month = (t.tm_year + 1, 1) if t.tm_mon == 12 else (t.tm_year, t.tm_mon + 1)
    return float(calendar.timegm((year, month, 1, 0, 0, 0)))


def period_id(period: str, at_s: float) -> str:
    return time.strftime("%Y%m%d" if period == "day" else "%Y%m", time.gmtime(at_s))


def _field(e: UsageEvent, count: str) -> str:
    return f"{e.key_id}|{e.adapter}|{e.model}|{count}"


class QuotaExceeded(Exception):
    def __init__(self, period: str, quota: int, used: int, resets_s: float, now_s: float) -> None:
        resets = datetime.fromtimestamp(resets_s, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        super().__init__(f"this tenant's token quota per {period} ({quota} tokens) is used up ({used} used); it resets at {resets}")
        self.retry_after_s = max(1, int(resets_s - now_s + 0.999))


class UsageLedger:
    """`client`: redis.asyncio's client (one Redis or a Cluster), or None: counts kept in memory."""

    def __init__(self, client, key_prefix: str, clock: Callable[[], float] = time.time) -> None:
        self.client, self.key_prefix, self.clock = client, key_prefix, clock
        self.is_cluster = client is not None and is_cluster(client)
        self._pending: deque[UsageEvent] = deque()
        self._memory: dict[tuple[str, str], Counter] = {}  # (tenant, hour) -> field -> count (no Redis)
        self._memory_periods: Counter = Counter()  # (tenant, period id) -> tokens (no Redis)
        self._quota_reads: dict[tuple[str, str], tuple[float, int]] = {}  # (tenant, period id) -> (read at, tokens)
        self._since_read: Counter = Counter()  # (tenant, period id) -> tokens counted here since that read
        self._script = None if client is None else client.register_script(_RECORD)
        self._retrier: asyncio.Task | None = None
        self._tasks: set[asyncio.Task] = set()
        self._lock = asyncio.Lock()
        self._tenants_key = f"{key_prefix}:usage:tenants"  # every tenant that has usage (the operator's listing)
        self._listed: set[str] = set()

    def _tag(self, tenant: str) -> str:
        base = f"{self.key_prefix}:usage:{tenant}"
        return f"{{{base}}}" if self.is_cluster else base

    def _keys(self, e: UsageEvent) -> list[str]:
        tag = self._tag(e.tenant)
        return [f"{tag}:req:{e.request_id}", f"{tag}:h:{hour_of(e.at_s)}", f"{tag}:d:{period_id('day', e.at_s)}",
                f"{tag}:m:{period_id('month', e.at_s)}"]

    # counting

    async def record(self, event: UsageEvent) -> None:
        """Count one request: written before this returns, unless Redis is down (then it waits to be)."""
        if self._take(event) and not self._is_retrying:
            await self.flush()

    def submit(self, event: UsageEvent) -> None:
        """Count one request without waiting for the write (a stream that was cancelled)."""
        if self._take(event) and not self._is_retrying:
            self._tasks.add(task := asyncio.get_running_loop().create_task(self.flush()))
            task.add_done_callback(self._tasks.discard)

    def _take(self, event: UsageEvent) -> bool:
        """Counted for the quotas, and kept to be written (False: kept in memory, no Redis)."""
        for period in ("day", "month"):
            self._since_read[(event.tenant, period_id(period, event.at_s))] += event.tokens
        if self.client is None:
            counts = self._memory.setdefault((event.tenant, hour_of(event.at_s)), Counter())
            for count, value in event.counts().items():
                counts[_field(event, count)] += value
            for period in ("day", "month"):
                self._memory_periods[(event.tenant, period_id(period, event.at_s))] += event.tokens
            return False
        self._pending.append(event)
        while len(self._pending) > MAX_PENDING:
            lost = self._pending.popleft()
            log.error("usage of request %s (tenant %s) dropped: %d counts wait for Redis", lost.request_id, lost.tenant, MAX_PENDING)
        return True

    @property
    def _is_retrying(self) -> bool:
        return self._retrier is not None and not self._retrier.done()

    async def flush(self) -> None:
        """Write what waits, oldest first; on a Redis failure it stays, tried again every RETRY_S."""
        if not await self._write_pending() and not self._is_retrying:
            self._retrier = asyncio.get_running_loop().create_task(self._retry())

    async def _retry(self) -> None:
        while self._pending:
            await asyncio.sleep(RETRY_S)
            await self._write_pending()

    async def _write_pending(self) -> bool:
        """True once nothing waits; False when Redis failed (what failed still waits)."""
        async with self._lock:
            while self._pending:
                event = self._pending[0]
                args: list[object] = [MARKER_TTL_S, RETENTION_S, event.tokens]
                for count, value in event.counts().items():
                    args += [_field(event, count), value]
                try:
                    await self._script(keys=self._keys(event), args=args)
                    if event.tenant not in self._listed:
                        await self.client.sadd(self._tenants_key, event.tenant)
                        self._listed.add(event.tenant)
                except client_errors() as e:
                    log.warning("usage not written yet (%s): %d request(s) wait", type(e).__name__, len(self._pending))
                    return False
                self._pending.popleft()
        return True

    async def tenants_with_usage(self) -> set[str]:
        if self.client is None:
            return {tenant for tenant, _ in self._memory}
        return {(t.decode() if isinstance(t, bytes) else t) for t in await self.client.smembers(self._tenants_key)}

    # quotas

    async def used_tokens(self, tenant: str, period: str) -> int:
        """The tenant's tokens this UTC day or month, read at most QUOTA_CACHE_S ago plus what was counted here since."""
        now_s = self.clock()
        pid = period_id(period, now_s)
        if self.client is None:
            return self._memory_periods[(tenant, pid)]
        read_s, tokens = self._quota_reads.get((tenant, pid), (-1e18, 0))
        if now_s - read_s > QUOTA_CACHE_S:
            key = f"{self._tag(tenant)}:{'d' if period == 'day' else 'm'}:{pid}"
            try:
                tokens = int(await self.client.hget(key, "tokens") or 0)
                since = sum(e.tokens for e in self._pending if e.tenant == tenant and period_id(period, e.at_s) == pid)
                tokens += since
                self._quota_reads[(tenant, pid)] = (now_s, tokens)
                self._since_read[(tenant, pid)] = 0
            except client_errors() as e:  # counted from what is known; not asked again before QUOTA_CACHE_S
                log.warning("quota of %s not read (%s): counted from what is known", tenant, type(e).__name__)
                self._quota_reads[(tenant, pid)] = (now_s, tokens)
        return tokens + self._since_read[(tenant, pid)]

    async def check_quota(self, tenant: str, quotas: dict[str, int | None], prompt_tokens: int) -> None:
        """QuotaExceeded when a period's tokens so far plus `prompt_tokens` are over its quota."""
        now_s = self.clock()
        for period, quota in quotas.items():
            if quota is None:
                continue
            used = await self.used_tokens(tenant, period)
            if used + prompt_tokens > quota:
                raise QuotaExceeded(period, quota, used, period_end_s(period, now_s), now_s)

    # reading

    async def rows(self, tenants: Iterable[str], start_s: float, end_s: float) -> list[dict[str, object]]:
        """Hourly rows of `tenants` from the hour holding `start_s` to the one before `end_s`: one per
        (hour, tenant, key, adapter, model), with every count (zeros included)."""
        hours = []
        at_s = start_s - start_s % 3600
        while at_s < end_s and len(hours) < MAX_QUERY_HOURS:
            hours.append(hour_of(at_s))
            at_s += 3600
        tenants = sorted(set(tenants))
        fetched: dict[tuple[str, str], dict] = {}
        if self.client is None:
            fetched = {(t, h): dict(self._memory.get((t, h), {})) for t in tenants for h in hours}
        else:
            for tenant in tenants:
                pipe = self.client.pipeline(transaction=False)
                for hour in hours:
                    pipe.hgetall(f"{self._tag(tenant)}:h:{hour}")
                for hour, raw in zip(hours, await pipe.execute()):
                    fetched[(tenant, hour)] = {(k.decode() if isinstance(k, bytes) else k): int(v) for k, v in raw.items()}
        out = []
        for (tenant, hour), fields in sorted(fetched.items(), key=lambda kv: (kv[0][1], kv[0][0])):
            groups: dict[tuple[str, str, str], dict[str, int]] = {}
            for name, value in fields.items():
                key_id, adapter, model, count = name.rsplit("|", 3)
                groups.setdefault((key_id, adapter, model), {})[count] = value
            for (key_id, adapter, model), counts in sorted(groups.items()):
                row: dict[str, object] = {"hour": _iso_hour(hour), "tenant": tenant, "key_id": key_id, "adapter": adapter,
                                          "model": model}
                row.update({c: counts.get(c, 0) for c in COUNTS})
                row.update({f"finish_{r}": counts.get(f"finish_{r}", 0) for r in FINISH_REASONS})
                out.append(row)
        return out


def _iso_hour(hour: str) -> str:
    return f"{hour[:4]}-{hour[4:6]}-{hour[6:8]}T{hour[8:10]}:00:00Z"


def open_ledger(redis_config, clock: Callable[[], float] = time.time) -> UsageLedger:
    if redis_config is None:
        return UsageLedger(None, "loraplex", clock)
    from cache.l2 import connect

    return UsageLedger(connect(redis_config, is_async=True), redis_config.key_prefix, clock)
