"""The usage ledger under faults and abuse: usage spooled to disk while the state store is down
survives the gateway's death and is counted once; a tenant cannot grow its hourly rows without
bound."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
import uuid

import pytest
import redis
import redis.asyncio

from cache.l2 import RedisConfig, connect
from gateway.tenancy.quota import QuotaUnavailable
from gateway.tenancy.usage import UsageLedger
from gateway.tenancy.usage_event import UsageEvent
from tests.gateway.tenancy.test_quota_reservations import event
from tests.redis_server import RedisServer

_DIES_WITH_USAGE_SPOOLED = """
import asyncio, os, sys, time
from pathlib import Path
import redis
from cache.l2 import RedisConfig, connect
from gateway.tenancy.usage import UsageLedger
from gateway.tenancy.usage_event import UsageEvent

url, spool = sys.argv[1], sys.argv[2]

async def main():
    ledger = UsageLedger(connect(RedisConfig(url=url, timeout_s=0.2), is_async=True), "spooled", spool_dir=Path(spool))
    reservations = [await ledger.reserve("acme", f"r{i}", 50, {"day": 200, "month": None}, 600.0) for i in range(3)]
    redis.Redis.from_url(url).shutdown(nosave=True)  # Redis goes away
    for i, r in enumerate(reservations):
        await ledger.record(UsageEvent(f"r{i}", "acme", "k1", "base", "tiny", 4, 6, 10, "stop", time.time(), r.at_s))
    os._exit(0)  # the gateway dies with its usage unwritten

asyncio.run(main())
"""


def test_usage_spooled_while_redis_is_down_survives_the_gateway(tmp_path, monkeypatch) -> None:
    """A gateway records 3 requests while Redis is down and dies: the next ledger on its spool
    directory writes them (once each, settling their reservations); until it has, tenants with a
    quota are refused as the backlog is past its bound (2 here)."""
    import gateway.tenancy.usage

    server = RedisServer().start()
    spool = tmp_path / "spool"
    try:
        done = subprocess.run([sys.executable, "-c", _DIES_WITH_USAGE_SPOOLED, server.url, str(spool)],
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        [left] = list(spool.glob("usage-*.jsonl"))
        assert [json.loads(line)["request_id"] for line in left.read_text().splitlines()] == ["r0", "r1", "r2"]
        server.process.wait(10)
        server.start()  # back, on the same port (and empty: the reservations are gone with it)
        monkeypatch.setattr(gateway.tenancy.usage, "MAX_PENDING", 2)

        async def scenario() -> list[dict]:
            client = connect(RedisConfig(url=server.url, timeout_s=0.5), is_async=True)
            ledger = UsageLedger(client, "spooled", spool_dir=spool)
            assert not left.exists() and len(ledger._pending) == 3  # taken over
            with pytest.raises(QuotaUnavailable, match="3 requests waits to be written"):
                await ledger.reserve("acme", "r9", 10, {"day": 200, "month": None}, 600.0)
            assert await ledger.flush()
            assert await ledger.flush()  # nothing left: nothing written twice
            assert ledger.spool.read() == []
            await ledger.reserve("acme", "r9", 10, {"day": 200, "month": None}, 600.0)  # admitted again
            rows = await ledger.rows(["acme"], time.time() - 3600, time.time() + 1)
            await client.aclose()
            return rows

        rows = asyncio.run(scenario())
        assert [(r["requests"], r["prompt_tokens"], r["completion_tokens"]) for r in rows] == [(3, 12, 30)]
    finally:
        server.stop()


def test_a_tenant_cannot_grow_its_hourly_rows_without_bound(prefix, monkeypatch) -> None:
    """Each new stack of adapters is a new row group in the hour; past the bound they share one (`*`),
    and the totals stay exact: the state store never evicts, so what a tenant may make it keep is bounded."""
    import gateway.tenancy.usage

    monkeypatch.setattr(gateway.tenancy.usage, "MAX_HOUR_FIELDS", 2 * 5)  # two row groups of 5 counts

    async def scenario() -> list[dict]:
        client = redis.asyncio.Redis()
        ledger = UsageLedger(client, prefix)
        now = time.time()
        for i in range(5):
            e = event(uuid.uuid4().hex, "acme", 10, i, None)
            await ledger.record(UsageEvent(**{**e.__dict__, "adapter": f"a{i}+b{i}"}))
        rows = await ledger.rows(["acme"], now - 3600, now + 3600)
        await client.aclose()
        return rows

    rows = asyncio.run(scenario())
    assert len(rows) == 3 and {r["adapter"] for r in rows} == {"a0+b0", "a1+b1", "*"}
    assert sum(r["requests"] for r in rows) == 5 and sum(r["completion_tokens"] for r in rows) == 0 + 1 + 2 + 3 + 4
    assert next(r for r in rows if r["adapter"] == "*")["requests"] == 3
