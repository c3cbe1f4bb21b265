"""The prefix cache's Redis tier on a real Redis Cluster (3 masters, 1 replica each): chunk keys spread
over every master, one pipeline per master, and what `cache.redis_cluster` accepts."""

from __future__ import annotations

import time

import numpy as np
import pytest

from bench.cluster.redis_cluster import LocalRedisCluster, free_node_port
from cache.codec import ChunkKV
from cache.keys import chunk_keys, root_key
from cache.l2 import RedisConfig, RedisTier, connect, is_cluster
from cache.prefix import ChunkGeometry, PrefixCache, PrefixCacheConfig

C = 4
GEOMETRY = ChunkGeometry("model-x", "float32", (2, 1, C, 3))
NUM_CHUNKS = 24
KEYS = chunk_keys(root_key("base", "set", "salt"), list(range(NUM_CHUNKS * C)), C)


def chunk(index: int) -> ChunkKV:
    k = np.random.default_rng(index).normal(size=GEOMETRY.shape).astype(np.float32)
    return ChunkKV(GEOMETRY.model_id, index * C, GEOMETRY.dtype, k, -k)


def open_cache(config: RedisConfig, l1_bytes: int = 0) -> PrefixCache:
    return PrefixCache(PrefixCacheConfig(chunk_tokens=C, l1_bytes=l1_bytes, redis=config), GEOMETRY)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory):
    with LocalRedisCluster(tmp_path_factory.mktemp("redis-cluster")).start() as cluster:
        yield cluster


@pytest.fixture
def config(cluster: LocalRedisCluster, request: pytest.FixtureRequest) -> RedisConfig:
    return RedisConfig(url=cluster.url, cluster=True, key_prefix=f"lp-{request.node.name[:40]}", timeout_s=0.5)


def test_chunks_spread_over_every_master_and_come_back_whole(cluster, config) -> None:
    writer = open_cache(config)
    assert is_cluster(writer.tier.client)
    writer.store([(key, chunk(i)) for i, key in enumerate(KEYS)])
    assert writer.flush(10.0) and writer.stats.num_store_errors == 0 and writer.tier.num_errors == 0
    assert {cluster.master_of(writer.tier.key(key)) for key in KEYS} == cluster.masters()  # no common hash tag

    reader = open_cache(config)  # another worker: nothing in its L1
    found = reader.lookup(KEYS)
    assert [c.first_position for c in found] == [i * C for i in range(NUM_CHUNKS)]
    assert all(np.array_equal(c.k, chunk(i).k) and np.array_equal(c.v, -chunk(i).k) for i, c in enumerate(found))
    assert reader.stats.num_chunks_hit_l2 == NUM_CHUNKS and reader.tier.num_round_trips == 1
    assert reader.redis_state == "ok" and reader.tier.num_errors == 0
    writer.close()
    reader.close()


def test_get_put_and_delete_many_across_slots(config) -> None:
    tier = RedisTier(None, config)  # connects at first use
    items = {f"key-{i}".encode(): f"value-{i}".encode() for i in range(40)}
    assert tier.put_many(items)
    keys = [b"missing", *items]
    assert tier.get_many(keys) == [None, *items.values()]
    assert 0 < tier.client.ttl(tier.key(b"key-0")) <= config.ttl_s
    tier.delete_many(list(items)[:30])
    assert tier.get_many(list(items)) == [None] * 30 + list(items.values())[30:]
    assert tier.num_errors == 0 and tier.num_round_trips == 4  # put, get, delete, get


def test_an_unreachable_cluster_is_a_redis_outage_not_a_failure_to_start() -> None:
    """The synchronous cluster client asks for the slot map as it is made: the tier makes it at first use."""
    config = RedisConfig(url=f"redis://127.0.0.1:{free_node_port()}/0", cluster=True, timeout_s=0.2, breaker_failures=2)
    cache = open_cache(config, l1_bytes=1 << 20)
    started = time.perf_counter()
    cache.store([(KEYS[0], chunk(0))])
    assert cache.flush(5.0)
    assert [c.first_position for c in cache.lookup(KEYS[:2])] == [0]  # L1 serves it; Redis is a miss
    assert cache.lookup(KEYS[1:2]) == [] and cache.redis_state == "degraded"
    assert time.perf_counter() - started < 3.0
    cache.close()


@pytest.mark.parametrize("options, message", [
    ({"url": "unix:///run/redis.sock"}, "seed node"),
    ({"url": "redis://cache:6379/2"}, "only database 0"),
    ({"key_prefix": "lp{x}"}, "hash tag"),
])
def test_what_a_cluster_config_refuses(options: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        RedisConfig(**{"url": "redis://cache:6379/0", "cluster": True, **options})
    RedisConfig(**{"url": "redis://cache:6379/0", **options})  # one Redis takes them


def test_connect_makes_a_cluster_client_with_the_timeouts(cluster) -> None:
    config = RedisConfig(url=cluster.url, cluster=True, timeout_s=0.3, password=None)
    client = connect(config)
    node = client.get_node_from_key("any")
    kwargs = client.get_redis_connection(node).connection_pool.connection_kwargs
    assert (kwargs["socket_timeout"], kwargs["socket_connect_timeout"]) == (0.3, 0.3)
    assert client.retry.get_retries() == 1
    client.close()
