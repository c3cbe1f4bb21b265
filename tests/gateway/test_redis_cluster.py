"""The gateway's Redis state on a real Redis Cluster (3 masters, 1 replica each): the registry's records,
version and leases in one slot, commits acknowledged by a replica (WAIT), the rate limiter's script, and
all of it, with the prefix cache, through the failover of a master killed right after a registry commit."""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import redis
import redis.asyncio
from redis.cluster import key_slot

from bench.cluster.redis_cluster import LocalRedisCluster
from cache.codec import ChunkKV
from cache.keys import chunk_keys, root_key
from cache.l2 import RedisConfig, connect
from cache.prefix import ChunkGeometry, PrefixCache, PrefixCacheConfig
from gateway.config import ServeConfig, parse_config
from gateway.errors import GatewayError
from gateway.registry.records import (
    AdapterRecord,
    RedisRecords,
    RegistryUnavailable,
    ReplicaDidNotAcknowledge,
)
from gateway.tenancy.ratelimit import REDIS_RETRY_S, RateLimiter
from gateway.tenancy.tenants import Tenant
from tests.redis_server import RedisServer

SCOPE = "lp:0123456789abcdef:"  # open_registry's key prefix: the deployment's, then the base model's
RECORD = AdapterRecord("acme", "caps", "fp-1", 1000, 8, ("attn_q",))


def added(record: AdapterRecord):
    return lambda records: ({record.key: record}, sorted(records))


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory):
    with LocalRedisCluster(tmp_path_factory.mktemp("redis-cluster")).start() as cluster:
        yield cluster


def cluster_config(cluster: LocalRedisCluster, **options) -> RedisConfig:
    return RedisConfig(**{"url": cluster.url, "cluster": True, "key_prefix": "lp", "timeout_s": 0.25, **options})


def test_the_config_file_takes_redis_cluster_next_to_redis_url() -> None:
    base = {"adapters": [{"name": "a", "path": "a.gguf"}], "shards": [{"name": "s", "adapters": ["a"]}], "auth": "none",
            "state": {"ephemeral": True}}
    config = parse_config({**base, "cache": {"redis_url": "redis://redis-cluster:6379/0", "redis_cluster": True}}, ".")
    assert config.cache.redis == RedisConfig(url="redis://redis-cluster:6379/0", cluster=True)
    dumped = config.model_dump()
    assert dumped["cache"]["redis_cluster"] is True and ServeConfig.model_validate(dumped) == config
    assert parse_config(base, ".").cache.redis.cluster is False


def test_one_redis_keeps_the_key_names_it_had() -> None:
    """Data written before an upgrade is read as it is, and old and new gateways share it during a rollout."""
    records = RedisRecords(redis.asyncio.Redis(), SCOPE)
    assert (records.records_key, records.version_key) == (f"{SCOPE}registry:records", f"{SCOPE}registry:version")
    assert RateLimiter(redis.asyncio.Redis(), "lp")._key("acme", "requests") == "lp:rl:acme:requests"


def test_the_registry_on_a_cluster_keeps_its_keys_in_one_slot(cluster) -> None:
    clock = [1_000.0]

    async def scenario() -> None:
        client = connect(cluster_config(cluster), is_async=True)
        records = RedisRecords(client, SCOPE, wall_clock=lambda: clock[0])
        assert (records.records_key, records.version_key) == ("{lp:0123456789abcdef:registry}:records",
                                                             "{lp:0123456789abcdef:registry}:version")
        assert key_slot(records.records_key.encode()) == key_slot(f"{records.version_key}:lease:replan".encode())
        assert await records.version() == 0 and await records.load() == (0, {})
        first = 1_000 * 1_000_000  # a store's first version: the wall clock in microseconds
        assert await records.transact(added(RECORD)) == (first, [])
        other = RedisRecords(connect(cluster_config(cluster), is_async=True), SCOPE, wall_clock=lambda: clock[0])  # another gateway
        # gateways racing: each change is applied once, on what the other committed
        results = await asyncio.gather(*(r.transact(added(replace(RECORD, name=f"n{i}")))
                                         for i, r in enumerate([records, other] * 3)))
        assert sorted(version for version, _ in results) == [first + i for i in range(1, 7)]
        version, found = await other.load()
        assert version == first + 6 and sorted(found) == ["acme/caps"] + [f"acme/n{i}" for i in range(6)]
        assert await records.lease("replan", 5.0) and not await other.lease("replan", 5.0)
        await client.delete(records.records_key, records.version_key)  # a cluster restarted empty
        assert await other.load() == (0, {})  # nothing comes back from anywhere
        clock[0] += 1.0  # a second later: the new store's versions start above every one the old reached
        assert (await records.transact(added(RECORD)))[0] == first + 1_000_000 > first + 6
        await client.aclose()
        await other.client.aclose()

    asyncio.run(scenario())


def test_the_rebalancers_lease_passes_to_another_gateway_once_its_holder_is_gone(cluster) -> None:
    async def scenario() -> None:
        holder, other, third = (RedisRecords(connect(cluster_config(cluster), is_async=True), SCOPE) for _ in range(3))
        lease = f"replan-{uuid.uuid4().hex[:6]}"
        assert await holder.lease(lease, 0.5) and not await other.lease(lease, 0.5)  # one gateway re-plans at a time
        await holder.client.aclose()  # its node is gone: it takes the lease no more
        started = time.monotonic()
        while not await other.lease(lease, 0.5):
            assert time.monotonic() - started < 2.0, "the lease did not pass on"
            await asyncio.sleep(0.05)
        assert 0.3 < time.monotonic() - started and not await third.lease(lease, 0.5)  # when it lapsed, and to one only
        await other.client.aclose()
        await third.client.aclose()

    asyncio.run(scenario())


def test_a_commit_waits_for_a_replica_and_says_so_when_none_answered(cluster) -> None:
    async def scenario() -> None:
        client = connect(cluster_config(cluster, timeout_s=1.0), is_async=True)  # room for a WAIT answered late
        records = RedisRecords(client, "lp:wait:", ack_timeout_s=0.1)
        await records.transact(added(RECORD))
        master = cluster.master_of(records.version_key)
        replica = redis.Redis(port=cluster.replica_of(master), single_connection_client=True, socket_timeout=1.0)
        replica.execute_command("READONLY")
        assert replica.hexists(records.records_key, RECORD.key)  # acknowledged before transact returned
        with cluster.paused(cluster.replica_of(master)):  # connected to its master, acknowledging nothing
            started = time.monotonic()
            with pytest.raises(ReplicaDidNotAcknowledge, match="none of its 1 replica"):
                await records.transact(added(replace(RECORD, name="late")))
            assert time.monotonic() - started < 1.0
        assert "acme/late" in (await records.load())[1]  # it is on the master: it stands unless a failover comes now
        cluster.wait_until_ok(10.0)
        await records.transact(added(replace(RECORD, name="again")))  # acknowledged again
        replica.close()
        await client.aclose()

    asyncio.run(scenario())


def test_on_one_redis_without_replicas_a_commit_does_not_wait() -> None:
    server = RedisServer().start()
    try:
        async def scenario() -> float:
            client = connect(RedisConfig(url=server.url, timeout_s=0.25), is_async=True)
            records = RedisRecords(client, SCOPE, ack_timeout_s=0.2, wall_clock=lambda: 2.0)
            started = time.monotonic()
            assert await records.transact(added(RECORD)) == (2_000_000, [])
            took = time.monotonic() - started
            assert await records.load() == (2_000_000, {RECORD.key: RECORD})
            await client.aclose()
            return took

        assert asyncio.run(scenario()) < 0.15  # WAIT answers 0 at once: no replica to wait for
    finally:
        server.stop()


def test_the_rate_limiter_keeps_a_tenants_keys_in_one_slot_and_shares_them(cluster) -> None:
    async def scenario() -> None:
        client = connect(cluster_config(cluster), is_async=True)
        now = time.time()
        one, other = (RateLimiter(client, "lp-rl", clock=lambda: now) for _ in range(2))  # two gateway replicas
        tenant = Tenant("acme", None, requests_per_min=6, tokens_per_min=100)  # a burst of one request
        assert one._key("acme", "requests") == "lp-rl:rl:{acme}:requests"
        await one.check(tenant, 60)
        with pytest.raises(GatewayError) as refused:
            await other.admit(tenant)  # the first one's request counted in the cluster
        assert refused.value.status == 429
        with pytest.raises(GatewayError, match="tokens per minute"):
            await other.spend(tenant, 60)
        assert await client.exists("lp-rl:rl:{acme}:requests", "lp-rl:rl:{acme}:tokens") == 2
        await client.aclose()

    asyncio.run(scenario())


# the failover

C = 4
GEOMETRY = ChunkGeometry("model-x", "float32", (2, 1, C, 3))
KEYS = chunk_keys(root_key("base", "set", "salt"), list(range(12 * C)), C)
RECOVERY_BOUND_S = 10.0  # from the kill: the cluster's own failover (node timeout 1 s: 2-3 s here), then the clients'
AFTER_FAILOVER_BOUND_S = 3.0  # from the replica's promotion (the cluster ok again) to each client working again
CALL_BOUND_S = 1.5  # any one call meanwhile (timeout 0.25 s, one retry, a slot-map refresh)


def chunk(index: int) -> ChunkKV:
    k = np.random.default_rng(index).normal(size=GEOMETRY.shape).astype(np.float32)
    return ChunkKV(GEOMETRY.model_id, index * C, GEOMETRY.dtype, k, -k)


class SkewedClock:
    """Wall time plus a skew the test moves ahead (the limiter's Redis retry period passes at once)."""

    def __init__(self) -> None:
        self.skew_s = 0.0

    def __call__(self) -> float:
        return time.time() + self.skew_s


def tenants_on(cluster: LocalRedisCluster, master: int, prefix: str) -> list[str]:
    """Tenant ids whose rate-limit keys are in `master`'s slots."""
    ranges = [r for r, port in cluster.masters_by_slots().items() if port == master]
    ids = (f"t{i}" for i in range(100_000))
    return [t for t in ids if any(first <= key_slot(f"{prefix}:rl:{{{t}}}:requests".encode()) <= last
                                  for first, last in ranges)][:200]


async def bounded(call):
    started = time.monotonic()
    try:
        return await call
    finally:
        assert time.monotonic() - started < CALL_BOUND_S, "a call waited on the dead master"


def test_after_a_master_is_killed_right_after_a_commit_everything_recovers(tmp_path: Path) -> None:
    with LocalRedisCluster(tmp_path).start() as cluster:
        config = cluster_config(cluster, breaker_cooldown_s=0.2)
        cache_config = PrefixCacheConfig(chunk_tokens=C, l1_bytes=0, redis=config)  # no L1: every lookup reads Redis
        writer, reader = PrefixCache(cache_config, GEOMETRY), PrefixCache(cache_config, GEOMETRY)
        writer.store([(key, chunk(i)) for i, key in enumerate(KEYS)])  # on every master
        assert writer.flush(10.0) and writer.stats.num_store_errors == 0
        clock = SkewedClock()

        async def scenario() -> dict[str, float]:
            client = connect(config, is_async=True)
            records = RedisRecords(client, SCOPE, ack_timeout_s=config.replica_ack_timeout_s)
            one, other = RateLimiter(client, "lp", clock=clock), RateLimiter(client, "lp", clock=clock)
            committed, _ = await records.transact(added(RECORD))
            master = cluster.master_of(records.version_key)
            tenants = iter(tenants_on(cluster, master, "lp"))
            killed_s = time.monotonic()
            cluster.kill(master)  # right after the 201

            async def registry_ok() -> bool:
                try:
                    version, found = await bounded(records.load())
                except RegistryUnavailable:
                    return False
                assert version == committed and found == {RECORD.key: RECORD}  # the acknowledged commit survived
                return True

            async def limiter_ok() -> bool:
                tenant = Tenant(next(tenants), None, requests_per_min=6)  # a burst of one, its keys on the killed master
                await bounded(one.admit(tenant))
                try:
                    await bounded(other.admit(tenant))
                except GatewayError:
                    return True  # refused: the two limiters counted in Redis again
                clock.skew_s += REDIS_RETRY_S  # they counted per process: let their retry period pass
                return False

            async def cache_ok() -> bool:
                started = time.monotonic()
                found = await asyncio.to_thread(reader.lookup, KEYS)
                assert time.monotonic() - started < CALL_BOUND_S, "a lookup waited on the dead master"
                assert reader.stats.num_corrupt == 0
                assert all(np.array_equal(c.k, chunk(i).k) for i, c in enumerate(found))  # a run of intact chunks
                return len(found) == len(KEYS)

            checks = {"registry": registry_ok, "limiter": limiter_ok, "cache": cache_ok}
            recovered_s: dict[str, float] = {}
            while len(recovered_s) < len(checks) + 1 and time.monotonic() - killed_s < RECOVERY_BOUND_S:
                for name, ok in checks.items():
                    if name not in recovered_s and await ok():
                        recovered_s[name] = time.monotonic() - killed_s
                if "failover" not in recovered_s and cluster.master_of(records.version_key) != master and cluster.is_ok():
                    recovered_s["failover"] = time.monotonic() - killed_s
                await asyncio.sleep(0.05)
            assert set(recovered_s) == {"failover", *checks}, f"only {recovered_s} within {RECOVERY_BOUND_S} s"
            assert all(s - recovered_s["failover"] < AFTER_FAILOVER_BOUND_S for s in recovered_s.values()), recovered_s
            # the promoted replica has no replica of its own: no WAIT, and a commit goes through
            assert (await records.transact(added(replace(RECORD, name="after"))))[0] > committed
            await client.aclose()
            return recovered_s

        try:
            recovered_s = asyncio.run(scenario())
            print(f"seconds from the kill until each worked again: {recovered_s}")
            for _ in range(2):  # the writer's tier recovers too (its first write may go to the dead master's address)
                written = writer.stats.num_bytes_written_l2
                writer.store([(KEYS[0], chunk(0))])
                assert writer.flush(5.0)
                if writer.stats.num_bytes_written_l2 > written:
                    break
            assert writer.stats.num_bytes_written_l2 > written and writer.redis_state == "ok"
        finally:
            writer.close()
            reader.close()


def test_usage_no_replica_holds_is_sent_again_and_survives_a_failover_counted_once(tmp_path: Path) -> None:
    """A usage write the master took but its replica did not (paused) is not done: it waits and is sent
    again. The master is lost, the replica takes over without it, and the write sent again lands there;
    the gateway's own retry of the same request counts nothing more."""
    from gateway.tenancy.usage import UsageLedger
    from gateway.tenancy.usage_event import UsageEvent

    with LocalRedisCluster(tmp_path).start() as cluster:
        async def scenario() -> list[dict]:
            client = connect(cluster_config(cluster, timeout_s=0.5), is_async=True)
            ledger = UsageLedger(client, "lp-usage", ack_timeout_s=0.2)
            now = time.time()
            event = UsageEvent(uuid.uuid4().hex, "acme", "key_1", "base", "tiny", 10, 0, 5, "stop", now, now)
            marker = ledger._keys(event)[0]
            master = cluster.master_of(marker)
            replica = cluster.replica_of(master)
            with cluster.paused(replica):
                await ledger.record(event)  # the master has it; no replica acknowledged it: it waits
                assert event.request_id in ledger._pending
                cluster.kill(master)  # lost with what only it held
            await asyncio.to_thread(cluster.wait_for_new_master, marker, master, 30.0)
            deadline = time.monotonic() + 30
            while event.request_id in ledger._pending:  # sent again, every RETRY_S, until a master holds it
                assert time.monotonic() < deadline, "the waiting usage was never written"
                await asyncio.sleep(0.2)
            await ledger.record(event)  # the gateway sends it again (it never heard back): counted once
            rows = await ledger.rows(["acme"], now - 3600, now + 3600)
            await client.aclose()
            return rows

        rows = asyncio.run(scenario())
        assert [(r["requests"], r["prompt_tokens"], r["completion_tokens"]) for r in rows] == [(1, 10, 5)]


def test_a_commit_after_one_was_lost_gets_a_version_no_gateway_has_seen() -> None:
    """A failover lost the last commit (the store is back at the version before it): the next change must not
    take the lost one's version (gateways that read the lost state would never read the new one)."""
    server = RedisServer().start()
    clock = [5.0]
    try:
        async def scenario() -> None:
            client = connect(RedisConfig(url=server.url, timeout_s=0.25), is_async=True)
            records = RedisRecords(client, SCOPE, wall_clock=lambda: clock[0])
            before, _ = await records.transact(added(RECORD))
            clock[0] += 0.001
            lost, _ = await records.transact(added(replace(RECORD, name="lost")))  # read by some gateway, then lost:
            await client.set(records.version_key, before)
            await client.hdel(records.records_key, replace(RECORD, name="lost").key)
            clock[0] += 0.001
            after, _ = await records.transact(added(replace(RECORD, name="revocation")))
            assert before < lost < after  # every gateway takes it
            clock[0] = 1.0  # a clock that went back: the version still goes forward
            assert (await records.transact(added(replace(RECORD, name="later"))))[0] == after + 1
            await client.aclose()

        asyncio.run(scenario())
    finally:
        server.stop()
