"""Usage a bill can be built on (torch-free): per tenant, key, adapter set, model and UTC hour,
the requests, prompt tokens, cached prompt tokens, generated tokens, and the requests by how they
finished; and the tenants' token quotas per UTC day and month (gateway/tenancy/quota.py), reserved at
admission and settled from the same counts.

Each answered request is counted once, by the gateway that answered it, when it ends (a
failover retry inside the gateway is one request; a stream the client cancelled counts what was
sent), and is written before its answer ends: an answer the client got is counted, across a
gateway restart. Kept in Redis under the deployment's key prefix: one hash per tenant and hour
(fields `key|adapter|model|count`), a day and a month total per tenant for the quotas, all of
one tenant in one Redis Cluster slot (a hash tag). One script writes a request: it first sets
the request's marker, so a write sent again (the reply was lost) counts nothing twice, and in
the same call replaces the request's quota reservation by what it used. Requests' writes go out
as they end, concurrently, each its own script call, and a write counts as done once a replica
of the Redis master holds it (WAIT on the same connection, when the master has replicas): one
that no replica acknowledged in time waits and is sent again (the marker makes that harmless),
so a failover of the master loses no usage an answer was given for.

Redis down: what waits to be written is kept in memory and, given a spool directory, appended
to a file there before the answer ends (gateway/tenancy/usage_spool.py), so it survives the process
dying; it is written when Redis answers again (tried every RETRY_S, WRITE_BATCH calls at once),
and a ledger opened on the directory writes what a dead gateway left there. Nothing is dropped:
while more than MAX_PENDING requests wait, the tenants with a quota are refused (503, logged),
as their quota cannot be known; the others are served and their usage kept. Without Redis the
counts are kept in memory only (one process; lost on restart).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import asdict, replace
from pathlib import Path

from redis.exceptions import RedisError

from cache.l2 import client_errors, is_cluster
from gateway.registry.records import on_master, replicas_of_master
from gateway.tenancy.quota import (
    PERIODS,
    RELEASE,
    RELEASE_FUNCTION,
    RENEW,
    RESERVE,
    MemoryQuotas,
    QuotaExceeded,
    QuotaUnavailable,
    Reservation,
    period_id,
)
from gateway.tenancy.usage_event import COUNTS, FINISH_REASONS, UsageEvent
from gateway.tenancy.usage_spool import Spool

log = logging.getLogger(__name__)
MARKER_TTL_S = 2 * 24 * 3600
RETENTION_S = 400 * 24 * 3600  # hourly counts are kept this long (a bill's period, and disputes)
MAX_PENDING = 100_000  # requests waiting for Redis; past it the tenants with a quota are refused
RETRY_S = 1.0
WRITE_BATCH = 64  # writes of waiting requests sent at once
REPLICAS_CHECK_S = 5.0  # how long a master's number of replicas is taken as known
# A tenant's rows in one hour: at most this many fields (256 adapter sets and keys, 9 counts each); the
# adapter sets past them are counted together under OTHER_ADAPTERS (the tenant picks its sets: the state
# store never evicts, so what one tenant may make it keep is bounded). Totals stay exact.
MAX_HOUR_FIELDS = 256 * (len(COUNTS) + len(FINISH_REASONS))
OTHER_ADAPTERS = "*"  # no adapter's name holds it
MAX_QUERY_HOURS = 93 * 24

# KEYS: marker, hour hash, day hash, month hash, reservations hash, expiries zset.
# ARGV: marker ttl, retention, tokens, request id, the most fields an hour hash takes, then (field, its
# overflow field, count) triples: a group not in a full hour hash is counted under its overflow fields.
_RECORD = RELEASE_FUNCTION + """
if not redis.call('SET', KEYS[1], '1', 'NX', 'EX', ARGV[1]) then return 0 end
release(KEYS[5], KEYS[6], ARGV[4])
local full = redis.call('HLEN', KEYS[2]) >= tonumber(ARGV[5]) and redis.call('HEXISTS', KEYS[2], ARGV[6]) == 0
for i = 6, #ARGV, 3 do redis.call('HINCRBY', KEYS[2], full and ARGV[i + 1] or ARGV[i], ARGV[i + 2]) end
redis.call('EXPIRE', KEYS[2], ARGV[2])
for _, key in ipairs({KEYS[3], KEYS[4]}) do
  redis.call('HINCRBY', key, 'tokens', ARGV[3])
  redis.call('HINCRBY', key, 'requests', 1)
  redis.call('EXPIRE', key, ARGV[2])
end
return 1
"""


def hour_of(at_s: float) -> str:
    return time.strftime("%Y%m%d%H", time.gmtime(at_s))


class NotAcknowledged(RedisError):
    """A usage write the master took and no replica acknowledged in time: it waits and is sent again."""


def _field(e: UsageEvent, count: str) -> str:
    return f"{e.key_id}|{e.adapter}|{e.model}|{count}"


class UsageLedger:
    """`client`: redis.asyncio's client (one Redis or a Cluster), or None: counts kept in memory.
    `spool_dir`: where requests waiting for Redis are kept on disk (None: in memory only)."""

    def __init__(self, client, key_prefix: str, clock: Callable[[], float] = time.time,
                 spool_dir: Path | None = None, ack_timeout_s: float = 0.1) -> None:
        self.client, self.key_prefix, self.clock = client, key_prefix, clock
        self.ack_timeout_ms = max(1, round(ack_timeout_s * 1000))
        self._replica_counts: dict[str, tuple[float, int]] = {}  # tenant's tag -> (asked at, its master's replicas)
        self.is_cluster = client is not None and is_cluster(client)
        self._pending: dict[str, UsageEvent] = {}  # request id -> its usage, not written yet
        self._releases: dict[str, Reservation] = {}  # request id -> its reservation, to give back
        self._memory: dict[tuple[str, str], Counter] = {}  # (tenant, hour) -> field -> count (no Redis)
        self._quotas = MemoryQuotas()  # no Redis
        self._scripts = None if client is None else {name: client.register_script(lua) for name, lua in
                                                     (("record", _RECORD), ("reserve", RESERVE), ("release", RELEASE),
                                                      ("renew", RENEW))}
        self._drainer: asyncio.Task | None = None
        self._down_until_s = 0.0  # monotonic: Redis failed, not asked again before this
        self._tenants_key = f"{key_prefix}:usage:tenants"  # every tenant that has usage (the operator's listing)
        self._listed: set[str] = set()
        self.spool = None if client is None or spool_dir is None else Spool(spool_dir)
        if self.spool is not None:
            for record in self.spool.adopt():
                try:
                    self._pending[record["request_id"]] = UsageEvent(**record)
                except (KeyError, TypeError) as e:
                    log.error("usage spool: a line that is no request's usage skipped (%s): %.200s", e, record)

    def _tag(self, tenant: str) -> str:
        base = f"{self.key_prefix}:usage:{tenant}"
        return f"{{{base}}}" if self.is_cluster else base

    def _period_key(self, tenant: str, period: str, at_s: float) -> str:
        return f"{self._tag(tenant)}:{'d' if period == 'day' else 'm'}:{period_id(period, at_s)}"

    def _reservation_keys(self, tenant: str) -> list[str]:
        tag = self._tag(tenant)
        return [f"{tag}:resv", f"{tag}:resv:exp"]

    def _keys(self, e: UsageEvent) -> list[str]:
        tag = self._tag(e.tenant)
        return [f"{tag}:req:{e.request_id}", f"{tag}:h:{hour_of(e.at_s)}",
                *(self._period_key(e.tenant, p, e.quota_at_s) for p in PERIODS), *self._reservation_keys(e.tenant)]

    # quotas

    async def reserve(self, tenant: str, request_id: str, num_tokens: int, quotas: dict[str, int | None],
                      lifetime_s: float) -> Reservation:
        """`num_tokens` held of the tenant's quotas (by period: "day", "month"; None: none) until the
        request is counted or released, or for `lifetime_s`. QuotaExceeded when they do not fit;
        QuotaUnavailable when the quotas cannot be checked."""
        now_s = self.clock()
        reservation = Reservation(request_id, tenant, num_tokens, now_s, now_s + lifetime_s)
        if self._scripts is None:
            self._quotas.reserve(reservation, quotas)
            return reservation
        self._wake()
        if len(self._pending) >= MAX_PENDING:
            raise QuotaUnavailable(f"the usage of {len(self._pending)} requests waits to be written: this tenant's quota "
                                   "cannot be checked until it is")
        if time.monotonic() < self._down_until_s:
            raise QuotaUnavailable("the usage store (Redis) cannot be reached: this tenant's quota cannot be checked")
        limits = [-1 if quotas.get(p) is None else quotas[p] for p in PERIODS]
        keys = [*(self._period_key(tenant, p, now_s) for p in PERIODS), *self._reservation_keys(tenant)]
        args = [repr(now_s), request_id, num_tokens, repr(reservation.expires_s), *(period_id(p, now_s) for p in PERIODS),
                *limits]
        try:
            reply = await self._scripts["reserve"](keys=keys, args=args)
        except client_errors() as e:
            self._failed(e)
            self.release(reservation)  # it may have been made, and its answer lost
            raise QuotaUnavailable("the usage store (Redis) cannot be reached: this tenant's quota cannot be "
                                   "checked") from e
        except asyncio.CancelledError:
            self.release(reservation)
            raise
        if int(reply[0]) == 0:
            period = PERIODS[int(reply[1]) - 1]
            raise QuotaExceeded(period, limits[int(reply[1]) - 1], int(reply[2]), int(reply[3]), num_tokens, now_s)
        return reservation

    async def renew(self, reservation: Reservation, expires_s: float) -> bool:
        """Make a reservation still held last until `expires_s` (its request runs on); False when it is not
        held any more (counted, released or expired) or Redis cannot be reached (it expires as it was)."""
        if self._scripts is None:
            return True
        keep_s = max(60, int(expires_s - self.clock()) + 60)
        try:
            return bool(await self._scripts["renew"](keys=self._reservation_keys(reservation.tenant),
                                                     args=[reservation.request_id, repr(expires_s), keep_s]))
        except client_errors() as e:
            log.warning("reservation of request %s not renewed (%s)", reservation.request_id, type(e).__name__)
            return False

    def release(self, reservation: Reservation) -> None:
        """Give back a reservation whose request never ran (nothing is counted); sent now, without waiting."""
        if self._scripts is None:
            self._quotas.release(reservation.request_id)
            return
        self._releases[reservation.request_id] = reservation
        self._drain_soon()

    # counting

    async def record(self, event: UsageEvent) -> None:
        """Count one request, which settles its reservation: written before this returns, unless Redis
        is down (then it waits to be, in the spool when there is one)."""
        if self._scripts is None:
            self._count_in_memory(event)
            return
        self._wake()
        if time.monotonic() >= self._down_until_s:
            try:
                await self._write(event)
                return
            except client_errors() as e:
                self._failed(e)
        self._keep(event)

    def _count_in_memory(self, event: UsageEvent) -> None:
        counts = self._memory.setdefault((event.tenant, hour_of(event.at_s)), Counter())
        for count, value in event.counts().items():
            counts[_field(event, count)] += value
        self._quotas.count(event.request_id, event.tenant, event.quota_at_s, event.tokens)

    def _keep(self, event: UsageEvent) -> None:
        """`event` waits for Redis: in memory, and on disk before this returns when there is a spool."""
        self._pending[event.request_id] = event
        if self.spool is not None:
            try:
                self.spool.append([asdict(event)])
            except OSError as e:
                log.error("usage of request %s (tenant %s) not spooled (%s): kept in memory only", event.request_id,
                          event.tenant, e)
        if len(self._pending) == MAX_PENDING:
            log.error("usage of %d requests waits for Redis: tenants with a quota are refused until it is written",
                      MAX_PENDING)
        self._drain_soon()

    async def _write(self, event: UsageEvent) -> None:
        """One request's count, done once a replica of the master holds it (or the master has none)."""
        from redis.exceptions import AskError, TryAgainError

        args: list[object] = [MARKER_TTL_S, RETENTION_S, event.tokens, event.request_id, MAX_HOUR_FIELDS]
        for count, value in event.counts().items():  # "requests" first: whether the row's group is there yet
            args += [_field(event, count), _field(replace(event, adapter=OTHER_ADAPTERS), count), value]
        keys = self._keys(event)
        num_replicas = await self._replicas(event.tenant, keys[0])
        write = ("EVAL", _RECORD, len(keys), *keys, *args)
        replies = await on_master(self.client, keys[0], [write, ("WAIT", 1, self.ack_timeout_ms)] if num_replicas else [write])
        if isinstance(replies[0], (AskError, TryAgainError)):  # the slot moved (a failover): learn where, send it again
            self._replica_counts.pop(self._tag(event.tenant), None)
            await self.client.exists(keys[0])
        for reply in replies:
            if isinstance(reply, Exception):
                raise reply
        if num_replicas and not int(replies[1]):
            self._replica_counts.pop(self._tag(event.tenant), None)
            raise NotAcknowledged(f"no replica acknowledged the usage of request {event.request_id} within "
                                  f"{self.ack_timeout_ms} ms: it waits and is sent again")
        if event.tenant not in self._listed:
            await self.client.sadd(self._tenants_key, event.tenant)
            self._listed.add(event.tenant)

    async def _replicas(self, tenant: str, key: str) -> int:
        """The replicas of the master of `tenant`'s slot (which holds `key`), asked at most every REPLICAS_CHECK_S."""
        tag = self._tag(tenant)
        known = self._replica_counts.get(tag)
        if known is not None and time.monotonic() - known[0] < REPLICAS_CHECK_S:
            return known[1]
        count = await replicas_of_master(self.client, key)
        self._replica_counts[tag] = (time.monotonic(), count)
        return count

    def _failed(self, error: Exception) -> None:
        if isinstance(error, NotAcknowledged):  # a replica lagging: the master answers, quotas can still be checked
            log.warning("%s", error)
            return
        self._down_until_s = time.monotonic() + RETRY_S
        log.warning("usage store (Redis) failed (%s): %d request(s) and %d release(s) wait", type(error).__name__,
                    len(self._pending), len(self._releases))

    def _wake(self) -> None:
        """Write what waits (a spool's lines left by a dead gateway, at the first use)."""
        if self._pending or self._releases:
            self._drain_soon()

    def _drain_soon(self) -> None:
        if self._drainer is None or self._drainer.done():
            self._drainer = asyncio.get_running_loop().create_task(self._drain())

    async def _drain(self) -> None:
        while not await self.flush():
            await asyncio.sleep(RETRY_S)

    async def flush(self) -> bool:
        """Write what waits, WRITE_BATCH calls at once; True once nothing waits (False: Redis failed)."""
        now_s = self.clock()
        for request_id in [i for i, r in self._releases.items() if r.expires_s <= now_s]:
            del self._releases[request_id]  # expired in Redis already
        while self._pending or self._releases:
            events = list(itertools.islice(self._pending.values(), WRITE_BATCH))
            releases = list(itertools.islice(self._releases.values(), WRITE_BATCH))
            sent = [self._write(e) for e in events]
            sent += [self._scripts["release"](keys=self._reservation_keys(r.tenant), args=[r.request_id]) for r in releases]
            results = await asyncio.gather(*sent, return_exceptions=True)
            failure = None
            for item, result in zip([*events, *releases], results):
                if isinstance(result, BaseException):
                    failure = result
                else:
                    (self._pending if isinstance(item, UsageEvent) else self._releases).pop(item.request_id, None)
            if failure is not None:
                if not isinstance(failure, client_errors()):
                    log.error("usage not written: %r", failure)
                self._failed(failure)
                return False
            self._down_until_s = 0.0
        if self.spool is not None:
            self.spool.clear()
        return True

    async def tenants_with_usage(self) -> set[str]:
        if self.client is None:
            return {tenant for tenant, _ in self._memory}
        return {(t.decode() if isinstance(t, bytes) else t) for t in await self.client.smembers(self._tenants_key)}

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


def open_ledger(redis_config, clock: Callable[[], float] = time.time, spool_dir: Path | None = None) -> UsageLedger:
    """The ledger in `redis_config`'s Redis (None: in memory), spooling to `spool_dir` while Redis is down."""
    if redis_config is None:
        return UsageLedger(None, "loraplex", clock)
    from cache.l2 import connect

    return UsageLedger(connect(redis_config, is_async=True), redis_config.key_prefix, clock, spool_dir,
                       redis_config.replica_ack_timeout_s)
