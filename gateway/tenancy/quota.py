"""Token quotas per UTC day and month that hold under concurrency (torch-free).

A request of a tenant with a quota reserves, when it is admitted, the most it may use (its
prompt plus n x its max_tokens bound) against the day's and the month's quota at once: it is
admitted only when, for each, the tokens counted so far, plus those reserved by requests in
flight, plus its own fit the quota. Its end settles the reservation: the script that counts
what it used (gateway/tenancy/usage.py) removes the reservation in the same call, so a request holds
its reservation until it is counted and then exactly what it used. A request that never ran
releases its reservation with nothing counted. A request's tokens count against the day and
month it was admitted in (its reservation's), never a period it was not checked against. One
that does not fit is refused (429, QuotaExceeded) saying how many tokens are left and when the
quota resets: Retry-After is that reset, or SOON_S when it would fit once the requests in flight
are counted (they hold tokens they may not use), so a client can retry, or lower max_tokens.

Kept in Redis next to the counts, under the tenant's hash tag (one Redis Cluster slot), shared
by every gateway: a hash of the reservations (`r:<request id>` -> "tokens day month") and of
their sums per period (`d:<day>`, `m:<month>`), and a sorted set of their expiries. Each reserve
first gives back the reservations past their expiry (the request's deadline plus the worker's
grace plus RESERVATION_MARGIN_S), so a gateway that died holding reservations does not hold the
tenant's quota for longer than that.

The bound: for each period, the tokens counted plus those reserved never exceed the quota, so
concurrent requests, through any number of gateways, never take a tenant past its quota
(overshoot 0), provided each request is counted before its reservation expires and uses at most
what it reserved (the worker stops at max_tokens). A request still running when its reservation
nears its expiry (a client that holds a stream unread past its deadline) has it renewed by its
gateway for as long as it runs; one counted after its reservation expired anyway (its gateway
could not reach Redis for that long) is counted all the same, as it is billed: it adds at most its
own reservation. Expiries are on the gateways' wall clocks: skew between gateways beyond the margin
shortens reservations by the skew.

Redis unreachable: nothing can be reserved, so a tenant with a quota is refused (503,
QuotaUnavailable), never admitted unchecked. Without Redis (one process), `MemoryQuotas` keeps the
same in memory.
"""

from __future__ import annotations

import calendar
import time
from collections import Counter
from dataclasses import dataclass
from datetime import UTC, datetime

PERIODS = ("day", "month")
RESERVATION_MARGIN_S = 60.0  # past a request's deadline and grace: the time to count it, and clock skew
SOON_S = 1  # Retry-After when the request may fit once the requests in flight are counted

# Gives back reservation `rid` (its tokens leave the period sums); every script that settles includes it.
RELEASE_FUNCTION = """
local function release(resv, exp, rid)
  redis.call('ZREM', exp, rid)
  local held = redis.call('HGET', resv, 'r:' .. rid)
  if not held then return 0 end
  redis.call('HDEL', resv, 'r:' .. rid)
  local tokens, day, month = string.match(held, '(%d+) (%S+) (%S+)')
  for _, field in ipairs({'d:' .. day, 'm:' .. month}) do
    if redis.call('HINCRBY', resv, field, -tonumber(tokens)) <= 0 then redis.call('HDEL', resv, field) end
  end
  return 1
end
"""

# KEYS: day hash, month hash, reservations hash, expiries zset.
# ARGV: now_s, request id, tokens, expires_s, day id, month id, day quota, month quota (-1: none).
# Returns {1} when reserved, else {0, period (1 day, 2 month), tokens counted in it, tokens reserved in it}.
RESERVE = RELEASE_FUNCTION + """
local now = tonumber(ARGV[1])
for _, rid in ipairs(redis.call('ZRANGEBYSCORE', KEYS[4], '-inf', now)) do release(KEYS[3], KEYS[4], rid) end
local tokens = tonumber(ARGV[3])
for i, period in ipairs({{KEYS[1], 'd:' .. ARGV[5], tonumber(ARGV[7])}, {KEYS[2], 'm:' .. ARGV[6], tonumber(ARGV[8])}}) do
  if period[3] >= 0 then
    local counted = tonumber(redis.call('HGET', period[1], 'tokens') or 0)
    local held = tonumber(redis.call('HGET', KEYS[3], period[2]) or 0)
    if counted + held + tokens > period[3] then return {0, i, counted, held} end
  end
end
redis.call('HSET', KEYS[3], 'r:' .. ARGV[2], ARGV[3] .. ' ' .. ARGV[5] .. ' ' .. ARGV[6])
redis.call('HINCRBY', KEYS[3], 'd:' .. ARGV[5], tokens)
redis.call('HINCRBY', KEYS[3], 'm:' .. ARGV[6], tokens)
redis.call('ZADD', KEYS[4], ARGV[4], ARGV[2])
local last = tonumber(redis.call('ZRANGE', KEYS[4], -1, -1, 'WITHSCORES')[2])
local keep_s = math.ceil(last - now) + 60  -- the keys outlive their last reservation
redis.call('EXPIRE', KEYS[3], keep_s)
redis.call('EXPIRE', KEYS[4], keep_s)
return {1}
"""

# KEYS: reservations hash, expiries zset; ARGV: request id.
RELEASE = RELEASE_FUNCTION + "return release(KEYS[1], KEYS[2], ARGV[1])"

# KEYS: reservations hash, expiries zset; ARGV: request id, its new expiry, seconds the keys are kept.
# -> 1 when the reservation was still held (and now lasts longer), else 0.
RENEW = """
if redis.call('HEXISTS', KEYS[1], 'r:' .. ARGV[1]) == 0 then return 0 end
redis.call('ZADD', KEYS[2], ARGV[2], ARGV[1])
for _, key in ipairs(KEYS) do
  if redis.call('TTL', key) < tonumber(ARGV[3]) then redis.call('EXPIRE', key, ARGV[3]) end
end
return 1
"""


@dataclass(frozen=True)
class Reservation:
    """Tokens a request holds of its tenant's quotas from its admission until it is counted."""

    request_id: str
    tenant: str
    num_tokens: int
    at_s: float  # when it was made (wall clock): its tokens count against this day and month
    expires_s: float


def period_end_s(period: str, at_s: float) -> float:
    """When the UTC day or month holding `at_s` ends (its quota resets)."""
    t = time.gmtime(at_s)
    if period == "day":
        return calendar.timegm((t.tm_year, t.tm_mon, t.tm_mday, 0, 0, 0)) + 86400.0
    year, month = (t.tm_year + 1, 1) if t.tm_mon == 12 else (t.tm_year, t.tm_mon + 1)
    return float(calendar.timegm((year, month, 1, 0, 0, 0)))


def period_id(period: str, at_s: float) -> str:
    return time.strftime("%Y%m%d" if period == "day" else "%Y%m", time.gmtime(at_s))


class QuotaExceeded(Exception):
    """The request cannot fit in what is left of a quota: how many tokens are left, and when it resets
    (`retry_after_s`; sooner when it would fit once the tenant's requests in flight are counted)."""

    def __init__(self, period: str, quota: int, num_counted: int, num_held: int, num_asked: int, now_s: float) -> None:
        resets_s = period_end_s(period, now_s)
        resets = datetime.fromtimestamp(resets_s, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        self.num_left = max(quota - num_counted, 0)  # not counted yet: free, or held by requests in flight
        num_held = min(num_held, self.num_left)
        held = f" ({num_held} of them held by requests in flight)" if num_held else ""
        super().__init__(f"this tenant's token quota per {period} ({quota} tokens) has {self.num_left} tokens "
                         f"left{held}; this request may use up to {num_asked} (its prompt and n x max_tokens): lower "
                         f"max_tokens, or retry; it resets at {resets}")
        self.is_soon = num_asked <= self.num_left  # it may fit once the requests in flight are counted
        self.retry_after_s = SOON_S if self.is_soon else max(1, int(resets_s - now_s + 0.999))


class QuotaUnavailable(Exception):
    """The quota cannot be checked now (Redis unreachable, or usage waiting to be written): refused, not admitted unchecked."""

    retry_after_s = 1


class MemoryQuotas:
    """The reservations and period counts of one process (no Redis), with the same rules."""

    def __init__(self) -> None:
        self.counted: Counter[tuple[str, str]] = Counter()  # (tenant, period id) -> tokens counted
        self.held: Counter[tuple[str, str]] = Counter()  # (tenant, period id) -> tokens reserved
        self.reservations: dict[str, Reservation] = {}

    def reserve(self, reservation: Reservation, quotas: dict[str, int | None]) -> None:
        """Reserved, or QuotaExceeded."""
        now_s = reservation.at_s
        for r in [r for r in self.reservations.values() if r.expires_s <= now_s]:
            self.release(r.request_id)
        for period, quota in quotas.items():
            if quota is None:
                continue
            key = (reservation.tenant, period_id(period, now_s))
            if self.counted[key] + self.held[key] + reservation.num_tokens > quota:
                raise QuotaExceeded(period, quota, self.counted[key], self.held[key], reservation.num_tokens, now_s)
        self.reservations[reservation.request_id] = reservation
        for period in PERIODS:
            self.held[(reservation.tenant, period_id(period, now_s))] += reservation.num_tokens

    def release(self, request_id: str) -> None:
        reservation = self.reservations.pop(request_id, None)
        if reservation is not None:
            for period in PERIODS:
                self.held[(reservation.tenant, period_id(period, reservation.at_s))] -= reservation.num_tokens

    def count(self, request_id: str, tenant: str, at_s: float, num_tokens: int) -> None:
        """A request's tokens counted in the periods of `at_s` (its admission), its reservation released."""
        self.release(request_id)
        for period in PERIODS:
            self.counted[(tenant, period_id(period, at_s))] += num_tokens
