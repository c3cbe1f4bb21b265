"""PrefixCache on its own (torch-free): tiers, one round trip, verification, the
writer, re-sharing, concurrency. Against the machine's Redis under a key prefix
of its own, or a Redis that is not there."""

from __future__ import annotations

import itertools
import threading
import time

import numpy as np
import pytest
import redis

from cache.codec import ChunkKV, decode, encode
from cache.keys import chunk_keys, root_key
from cache.l2 import RedisConfig
from cache.prefix import MAX_WRITE_PAUSE_S, ChunkGeometry, PrefixCache, PrefixCacheConfig
from tests.redis_server import free_port

C = 4
GEOMETRY = ChunkGeometry("model-x", "float32", (2, 1, C, 3))


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def chunk(index: int, fill: float | None = None, geometry: ChunkGeometry = GEOMETRY) -> ChunkKV:
    rng = np.random.default_rng(index)
    k = rng.normal(size=geometry.shape).astype(np.float32) if fill is None else np.full(geometry.shape, fill, np.float32)
    return ChunkKV(geometry.model_id, index * C, geometry.dtype, k, -k)


KEYS = chunk_keys(root_key("base", "set", "salt"), list(range(6 * C)), C)


def open_cache(prefix: str, clock=None, **options) -> PrefixCache:
    redis_options = {
        k: options.pop(k) for k in list(options) if k in ("url", "ttl_s", "breaker_failures", "breaker_cooldown_s", "timeout_s")
    }
    config = PrefixCacheConfig(chunk_tokens=C, redis=RedisConfig(key_prefix=prefix, **redis_options), **options)
    return PrefixCache(config, GEOMETRY, clock=clock or Clock())


def test_one_round_trip_finds_the_run_after_l1_and_l1_serves_it_next_time(redis_prefix) -> None:
    writer, reader = open_cache(redis_prefix), open_cache(redis_prefix)
    writer.store([(k, chunk(i)) for i, k in enumerate(KEYS[:4])])
    assert writer.flush()
    found = reader.lookup(KEYS)
    assert [c.first_position for c in found] == [0, 4, 8, 12]
    assert np.array_equal(found[3].k, chunk(3).k) and np.array_equal(found[3].v, chunk(3).v)
    assert reader.tier.num_round_trips == 1 and reader.stats.num_chunks_hit_l2 == 4 and reader.stats.num_chunks_missed == 2
    assert len(reader.lookup(KEYS[:4])) == 4
    assert reader.tier.num_round_trips == 1 and reader.stats.num_chunks_hit_l1 == 4  # all from L1: Redis not asked


def test_a_missing_chunk_ends_the_run(redis_prefix) -> None:
    writer = open_cache(redis_prefix)
    writer.store([(KEYS[0], chunk(0)), (KEYS[1], chunk(1)), (KEYS[3], chunk(3))])
    assert writer.flush()
    assert len(open_cache(redis_prefix).lookup(KEYS)) == 2


@pytest.mark.parametrize("wrong", [
    ChunkGeometry("model-x", "float16", (2, 1, C, 3)),  # another dtype
    ChunkGeometry("model-x", "float32", (2, 2, C, 3)),  # another shape
    ChunkGeometry("model-y", "float32", (2, 1, C, 3)),  # another model
])
def test_a_value_this_worker_cannot_use_is_corrupt_and_deleted(redis_prefix, wrong) -> None:
    client = redis.Redis()
    client.set(f"{redis_prefix}:kv:{KEYS[0].hex()}", encode(chunk(0, geometry=wrong)))
    cache = open_cache(redis_prefix)
    assert cache.lookup(KEYS[:1]) == [] and cache.stats.num_corrupt == 1
    assert cache.flush() and client.get(f"{redis_prefix}:kv:{KEYS[0].hex()}") is None


def test_redis_down_lookups_use_l1_and_writes_are_not_waited_for(tmp_path) -> None:
    cache = open_cache("loraplex-test", url=f"redis://127.0.0.1:{free_port()}/0", timeout_s=0.2, breaker_failures=1, breaker_cooldown_s=60)
    cache.store([(KEYS[0], chunk(0))])
    assert cache.flush()
    assert len(cache.lookup(KEYS[:3])) == 1  # L1 still serves
    assert cache.redis_state == "degraded" and cache.health()["redis"] == "degraded"
    assert cache.stats.num_bytes_written_l2 == 0 and cache.tier.num_errors == 1


def test_the_writer_drops_and_counts_when_it_falls_behind(redis_prefix) -> None:
    cache = open_cache(redis_prefix, max_pending_writes=3)
    gate = threading.Event()
    real_put = cache.tier.put_many
    cache.tier.put_many = lambda items: gate.wait(10) and real_put(items)  # a slow Redis
    cache.store([(KEYS[0], chunk(0)), (KEYS[1], chunk(1))])
    cache.store([(KEYS[2], chunk(2)), (KEYS[3], chunk(3))])  # 4 > 3 pending: dropped, the caller never waits
    assert cache.stats.num_writes_dropped == 2 and len(cache.lookup(KEYS)) == 4  # L1 has them all
    gate.set()
    assert cache.flush()
    reader = open_cache(redis_prefix)
    assert len(reader.lookup(KEYS)) == 2
    cache.lookup(KEYS)  # serving the dropped ones from L1 queues them again
    assert cache.flush() and len(open_cache(redis_prefix).lookup(KEYS)) == 4


def test_the_writer_pauses_after_each_write_but_not_while_flushed(redis_prefix) -> None:
    """write_pause: the writer waits that many times as long as a write took before the next
    (burst KV reaches Redis spread out); a flush cuts the pauses short."""
    cache = open_cache(redis_prefix, write_pause=3.0)
    writes: list[tuple[float, float]] = []  # (start, end) of each write
    real_put = cache.tier.put_many

    def slow_put(items) -> bool:  # each write takes >= 20 ms: the pause after it >= 60 ms
        began = time.perf_counter()
        time.sleep(0.02)
        ok = real_put(items)
        writes.append((began, time.perf_counter()))
        return ok

    cache.tier.put_many = slow_put
    for i in range(3):
        cache.store([(KEYS[i], chunk(i))])
    while len(writes) < 3:
        time.sleep(0.01)
    for (began, ended), (next_began, _) in itertools.pairwise(writes):
        assert next_began - ended >= 3.0 * (ended - began) * 0.99
    cache = open_cache(redis_prefix, write_pause=1000.0)  # pauses of MAX_WRITE_PAUSE_S
    cache.tier.put_many = lambda items: time.sleep(0.01) or real_put(items)
    for i in range(6):
        cache.store([(KEYS[i], chunk(i))])
    assert cache.flush(timeout_s=MAX_WRITE_PAUSE_S * 3)  # unpaused: not 6 pauses long
    assert len(open_cache(redis_prefix).lookup(KEYS)) == 6
    with pytest.raises(ValueError, match="write_pause"):
        PrefixCacheConfig(write_pause=-1.0)


def test_chunks_served_from_l1_are_rewritten_every_half_ttl(redis_prefix) -> None:
    clock = Clock()
    cache = open_cache(redis_prefix, clock, ttl_s=100)
    cache.store([(KEYS[0], chunk(0))])
    assert cache.flush()
    writes = cache.tier.num_round_trips
    clock.now += 40
    cache.lookup(KEYS[:1])
    assert cache.flush() and cache.tier.num_round_trips == writes  # fresh enough: no write
    clock.now += 20  # 60 s > 50 s since the write
    redis.Redis().delete(f"{redis_prefix}:kv:{KEYS[0].hex()}")  # as if evicted
    cache.lookup(KEYS[:1])
    assert cache.flush() and cache.tier.num_round_trips == writes + 1
    assert len(open_cache(redis_prefix).lookup(KEYS[:1])) == 1


def test_workers_writing_the_same_chunks_at_once_leave_only_whole_values(redis_prefix) -> None:
    caches = [open_cache(redis_prefix) for _ in range(4)]

    def write(worker: int) -> None:
        for _ in range(20):  # each worker's values differ (as KV from different batches may, in the last bits)
            caches[worker].store([(k, chunk(i, fill=float(worker))) for i, k in enumerate(KEYS)])

    threads = [threading.Thread(target=write, args=(w,)) for w in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(c.flush() for c in caches)
    client = redis.Redis()
    for i, key in enumerate(KEYS):
        value = decode(client.get(f"{redis_prefix}:kv:{key.hex()}"), GEOMETRY.model_id)
        assert value.first_position == i * C and len(set(value.k.ravel().tolist())) == 1  # one writer's value, whole
    assert len(open_cache(redis_prefix).lookup(KEYS)) == len(KEYS)


def test_metrics_in_prometheus_text(redis_prefix) -> None:
    cache = open_cache(redis_prefix)
    cache.store([(KEYS[0], chunk(0))])
    cache.flush()
    open_cache(redis_prefix).lookup(KEYS[:2])
    cache.lookup(KEYS[:2])
    text = cache.prometheus()
    assert 'loraplex_cache_hit_chunks_total{tier="l1"} 1' in text
    assert "loraplex_cache_chunks_missed_total 1" in text
    assert "loraplex_cache_lookup_seconds_count 1" in text and 'loraplex_cache_lookup_seconds_bucket{le="+Inf"} 1' in text
    assert 'loraplex_cache_redis_state{state="ok"} 1' in text
    assert f"loraplex_cache_written_bytes_total {len(encode(chunk(0)))}" in text


def test_config_is_checked() -> None:
    with pytest.raises(ValueError, match="chunk_tokens"):
        PrefixCacheConfig(chunk_tokens=0)
    with pytest.raises(ValueError, match="redis url"):
        RedisConfig(url="http://example.com")
    assert RedisConfig(url="rediss://:secret@cache.internal:6380/0").safe_url == "rediss://***@cache.internal:6380/0"
    with pytest.raises(ValueError, match="tokens"):
        PrefixCache(PrefixCacheConfig(chunk_tokens=8), GEOMETRY)
