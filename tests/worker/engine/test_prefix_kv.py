"""The engine with the prefix cache, on a tiny model and the machine's Redis (own key prefix).

Each "worker" is an engine with its own PrefixCache (its own L1 and Redis
connection), so a hit in a second one came through Redis.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import struct

import pytest
import redis

from cache.codec import CHECKSUM_BYTES
from cache.keys import chunk_keys
from cache.l2 import RedisConfig
from cache.prefix import PrefixCacheConfig
from tests.helpers import TEST_DEVICE, results_of
from tests.redis_server import RedisServer
from tests.tinymodels import TinySpec, invocation_metadata, make_tiny_model, random_lora, write_adapter
from worker.contract.params import SamplingParams
from worker.contract.spec import EngineConfig
from worker.engine import prefix_kv
from worker.engine.engine import Engine, EngineRequest
from worker.engine.loop import EngineLoop
from worker.engine.runner import ModelRunner
from worker.lora.mapping import RequestAdapters

C = 8
ATTN = ["blk.0.attn_q.weight", "blk.0.attn_k.weight", "blk.0.attn_v.weight", "blk.1.attn_output.weight"]
INVOCATION = [250, 12]
GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=2)
PROMPT = [(7 * i + 3) % 240 for i in range(45)]  # 5 whole chunks of the first 44 tokens


@pytest.fixture(scope="module")
def adapter_dir(tiny_llama, tmp_path_factory):
    d = tmp_path_factory.mktemp("cache-adapters")
    write_adapter(d / "a.gguf", random_lora(tiny_llama, ATTN, 4, seed=21))
    write_adapter(d / "b.gguf", random_lora(tiny_llama, ATTN, 4, seed=22))
    write_adapter(d / "alora1.gguf", random_lora(tiny_llama, ATTN, 4, seed=23), metadata=invocation_metadata(INVOCATION))
    write_adapter(d / "alora2.gguf", random_lora(tiny_llama, ATTN, 4, seed=24), metadata=invocation_metadata(INVOCATION))
    shutil.copy(d / "a.gguf", d / "tenant-x-renamed.gguf")
    return d


@pytest.fixture(scope="module")
def runner(tiny_llama, adapter_dir) -> ModelRunner:
    names = ["a", "b", "alora1", "alora2"]
    return ModelRunner.from_paths(tiny_llama.path, [adapter_dir / f"{n}.gguf" for n in names], TEST_DEVICE)


@pytest.fixture(scope="module")
def other_layout(tiny_llama, adapter_dir) -> ModelRunner:
    """Another worker: the same base, adapter a under another file name, in another slot."""
    return ModelRunner.from_paths(tiny_llama.path, [adapter_dir / "b.gguf", adapter_dir / "tenant-x-renamed.gguf"], TEST_DEVICE)


def open_cache(runner, prefix: str, url: str = "redis://127.0.0.1:6379/0", **redis_options):
    return prefix_kv.open_prefix_cache(
        runner, PrefixCacheConfig(chunk_tokens=C, redis=RedisConfig(url=url, key_prefix=prefix, **redis_options))
    )


def run(runner, cache, prompt=PROMPT, adapters=None, salt="t1", params=GREEDY, **fields):
    engine = Engine(runner, None, EngineConfig(num_seq_slots=2, slot_len=128, max_step_tokens=16), prefix_cache=cache)
    request = EngineRequest("r", list(prompt), params, adapters or {}, cache_salt=salt, **fields)
    result = engine.run_all([request])["r"]
    if cache is not None:
        assert cache.flush()
    return result


def assert_same_output(cached, uncached) -> None:
    assert cached.token_ids == uncached.token_ids
    for a, b in zip(cached.logprobs, uncached.logprobs):
        assert a.logprob == pytest.approx(b.logprob, abs=1e-4)


def redis_values(prefix: str) -> dict[str, bytes]:
    client = redis.Redis()
    return {k.decode(): client.get(k) for k in client.scan_iter(f"{prefix}:kv:*")}


def test_a_second_worker_reuses_the_first_ones_chunks_through_redis(runner, redis_prefix) -> None:
    uncached = run(runner, None, adapters={0: 1.0})
    worker_a, worker_b = open_cache(runner, redis_prefix), open_cache(runner, redis_prefix)
    first = run(runner, worker_a, adapters={0: 1.0})
    assert first.cached_tokens == 0 and first.token_ids == uncached.token_ids
    assert len(redis_values(redis_prefix)) == (len(PROMPT) + GREEDY.max_tokens - 1) // C  # prompt and generated chunks

    second = run(runner, worker_b, adapters={0: 1.0})
    assert second.cached_tokens == 40  # whole chunks of all but the last prompt token
    assert worker_b.stats.num_chunks_hit_l2 == 5 and worker_b.stats.num_chunks_hit_l1 == 0
    assert worker_b.tier.num_round_trips == 1 + 1  # one lookup, one pipelined write of its new chunk
    assert_same_output(second, uncached)

    third = run(runner, worker_b, adapters={0: 1.0})  # now from its own L1: no lookup round trip
    assert third.cached_tokens == 40 and worker_b.stats.num_chunks_hit_l1 == 5
    assert worker_b.tier.num_round_trips == 2 + 1
    assert_same_output(third, uncached)


def test_a_cpu_engine_paces_its_cache_writes_unless_told_otherwise(runner, redis_prefix) -> None:
    """The writer shares a CPU engine's cores (with Redis): it pauses between writes there."""
    expected = prefix_kv.CPU_WRITE_PAUSE if runner.config.torch_device.type == "cpu" else 0.0
    assert open_cache(runner, redis_prefix).config.write_pause == expected
    told = PrefixCacheConfig(chunk_tokens=C, redis=RedisConfig(key_prefix=redis_prefix), write_pause=0.5)
    assert prefix_kv.open_prefix_cache(runner, told).config.write_pause == 0.5


@pytest.mark.parametrize(("adapters", "salt"), [
    ({0: 1.0}, "t2"),  # another tenant
    ({1: 1.0}, "t1"),  # another adapter
    ({0: 0.5}, "t1"),  # another scale
    ({0: 1.0, 1: 0.3}, "t1"),  # another stack
    ({}, "t1"),  # the base alone
])
def test_anything_that_changes_the_kv_or_the_tenant_misses(runner, redis_prefix, adapters, salt) -> None:
    run(runner, open_cache(runner, redis_prefix), adapters={0: 1.0}, salt="t1")
    result = run(runner, open_cache(runner, redis_prefix), adapters=adapters, salt=salt)
    assert result.cached_tokens == 0
    assert_same_output(result, run(runner, None, adapters=adapters))


def test_another_base_misses(runner, redis_prefix, tmp_path) -> None:
    other = make_tiny_model(tmp_path, TinySpec(arch="llama", seed=5))  # same shapes, other weights
    other_runner = ModelRunner.from_paths(other.path, [], TEST_DEVICE)
    run(runner, open_cache(runner, redis_prefix))
    assert run(other_runner, open_cache(other_runner, redis_prefix)).cached_tokens == 0


def test_the_same_adapter_file_under_another_name_and_slot_hits_and_scale_zero_is_the_base(runner, other_layout, redis_prefix) -> None:
    run(runner, open_cache(runner, redis_prefix), adapters={0: 1.0})
    renamed = run(other_layout, open_cache(other_layout, redis_prefix), adapters={1: 1.0, 0: 0.0})
    assert renamed.cached_tokens == 40
    assert_same_output(renamed, run(runner, None, adapters={0: 1.0}))


def test_alora_requests_share_only_the_chunks_before_activation_with_the_base(runner, redis_prefix) -> None:
    prompt = [(5 * i + 1) % 240 for i in range(37)] + INVOCATION + [60, 61, 62, 63, 64, 65, 66, 67, 68, 69, 70]  # invocation at 37
    activation = 36  # llama.cpp's rule: one before the invocation
    uncached = {slot: run(runner, None, prompt, {slot: 1.0}) for slot in (2, 3)}
    first = run(runner, open_cache(runner, redis_prefix), prompt, {2: 1.0})
    assert first.alora_activation == activation and first.cached_tokens == 0
    base_root = prefix_kv.request_root(runner, prefix_kv.cache_model_id(runner), RequestAdapters(), "t1")
    expected = {f"{redis_prefix}:kv:{k.hex()}" for k in chunk_keys(base_root, prompt, C, activation)}
    assert set(redis_values(redis_prefix)) == expected and len(expected) == 4  # under the base's key, nothing at or after 36

    base = run(runner, open_cache(runner, redis_prefix), prompt)
    assert base.cached_tokens == 32
    for slot in (2, 3):  # both aLoRAs, fresh workers: the base's pre-activation chunks
        result = run(runner, open_cache(runner, redis_prefix), prompt, {slot: 1.0})
        assert result.cached_tokens == 32
        assert_same_output(result, uncached[slot])


def _rewrite_header(blob: bytes, **changes) -> bytes:
    (header_len,) = struct.unpack_from("<I", blob, 4)
    header = json.loads(blob[8 : 8 + header_len]) | changes
    new_header = json.dumps(header, sort_keys=True).encode()
    body = blob[:4] + struct.pack("<I", len(new_header)) + new_header + blob[8 + header_len : -CHECKSUM_BYTES]
    return body + hashlib.sha256(body).digest()


BAD_VALUES = {
    "flipped byte": lambda blob: blob[:100] + bytes([blob[100] ^ 1]) + blob[101:],
    "truncated": lambda blob: blob[: len(blob) // 2],
    "other format version": lambda blob: _rewrite_header(blob, version=99),
    "other position": lambda blob: _rewrite_header(blob, first_position=0),
    "garbage": lambda blob: b"not a value at all",
}


@pytest.mark.parametrize("damage", BAD_VALUES)
def test_a_bad_value_is_a_miss_deleted_and_counted(runner, redis_prefix, damage) -> None:
    writer = open_cache(runner, redis_prefix)
    run(runner, writer)
    bad_key = chunk_keys(prefix_kv.request_root(runner, writer.geometry.model_id, RequestAdapters(), "t1"), PROMPT, C)[2]
    client, name = redis.Redis(), f"{redis_prefix}:kv:{bad_key.hex()}"
    client.set(name, BAD_VALUES[damage](client.get(name)))

    reader = open_cache(runner, redis_prefix)
    result = run(runner, reader)
    assert result.cached_tokens == 2 * C  # the chunks before the bad one
    assert reader.stats.num_corrupt == 1 and "loraplex_cache_corrupt_values_total 1" in reader.prometheus()
    assert_same_output(result, run(runner, None))
    from cache.codec import decode

    assert decode(client.get(name), reader.geometry.model_id).first_position == 2 * C  # deleted, then stored afresh


def test_a_growing_conversation_reuses_its_earlier_turns(runner, redis_prefix) -> None:
    cache = open_cache(runner, redis_prefix)
    turn1 = run(runner, cache, PROMPT[:20], params=SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    prompt2 = PROMPT[:20] + turn1.token_ids + [9, 8, 7, 6, 5]
    turn2 = run(runner, cache, prompt2, params=SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    assert turn2.cached_tokens == 24  # the chunks of the first prompt and of the reply the first turn computed
    assert turn2.token_ids == run(runner, None, prompt2, params=SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)).token_ids


def test_prompt_logprobs_and_cache_prompt_false_are_computed_in_full(runner, redis_prefix) -> None:
    cache = open_cache(runner, redis_prefix)
    run(runner, cache)
    echo = SamplingParams(max_tokens=2, temperature=0, echo=True, logprobs=1)
    assert run(runner, cache, params=echo).cached_tokens == 0  # every prompt position needs its logits
    assert run(runner, cache, cache_prompt=False).cached_tokens == 0
    secret = [200 - i for i in range(30)]
    assert run(runner, cache, secret, cache_prompt=False).cached_tokens == 0
    assert run(runner, open_cache(runner, redis_prefix), secret + [1]).cached_tokens == 0  # it was not stored either


def test_the_engine_loop_looks_up_in_the_submitting_thread(runner, redis_prefix) -> None:
    run(runner, open_cache(runner, redis_prefix))
    cache = open_cache(runner, redis_prefix)
    loop = EngineLoop(Engine(runner, None, EngineConfig(num_seq_slots=2, slot_len=128, max_step_tokens=16), prefix_cache=cache))
    try:
        outs = list(loop.submit(EngineRequest("x", PROMPT, GREEDY, cache_salt="t1")))
    finally:
        loop.close()
    assert outs[-1].usage.cached_tokens == 40 and [t for o in outs for t in o.token_ids] == run(runner, None).token_ids


def test_redis_down_means_uncached_success_then_caching_resumes_when_it_returns(runner) -> None:
    server = RedisServer().start()
    try:
        options = dict(breaker_failures=1, breaker_cooldown_s=0.3, timeout_s=0.2)
        cache = open_cache(runner, "loraplex-test", server.url, **options)
        uncached = run(runner, None)
        run(runner, cache, PROMPT[:30])
        server.stop()
        during = run(runner, cache)  # an L1 miss, Redis gone
        assert during.finish_reason == "length" and during.cached_tokens == 24  # its own L1 still serves
        assert_same_output(during, uncached)
        assert cache.health()["redis"] == "degraded" and 'loraplex_cache_redis_state{state="degraded"} 1' in cache.prometheus()

        server.start()  # an empty Redis on the same port
        import time

        time.sleep(0.35)  # past the breaker's cool-down: the next call probes
        run(runner, cache, PROMPT[:30] + [3, 3, 3, 3, 3, 3, 3, 3, 3])
        run(runner, cache, PROMPT[:30] + [3, 3, 3, 3, 3, 3, 3, 3, 3])
        assert cache.health()["redis"] == "ok"
        fresh = run(runner, open_cache(runner, "loraplex-test", server.url, **options), PROMPT[:30] + [3, 3, 3, 3, 3, 3, 3, 3, 3])
        assert fresh.cached_tokens == 32  # written after Redis came back, read by another worker
    finally:
        server.stop()


def test_a_gemma3_prefix_longer_than_its_sliding_window_comes_back_whole(tiny_gemma3, redis_prefix) -> None:
    """Every position's K and V are cached, not only the window's: a hit continues exactly as a cold run."""
    runner = ModelRunner.from_paths(tiny_gemma3.path, [], TEST_DEVICE)
    assert runner.hparams.sliding_window < len(PROMPT) // 4
    uncached = run(runner, None)
    first = run(runner, open_cache(runner, redis_prefix))
    second = run(runner, open_cache(runner, redis_prefix))
    assert (first.cached_tokens, second.cached_tokens) == (0, 40)
    assert_same_output(first, uncached)
    assert_same_output(second, uncached)


def test_an_moe_base_with_an_expert_adapter_continues_from_a_hit_as_from_a_cold_run(tiny_qwen3moe, redis_prefix, tmp_path) -> None:
    """The KV of a Qwen3-MoE prefix computed with an adapter on the experts, cached and loaded back;
    the base's own run does not hit it (the adapter fingerprint is in the key)."""
    targets = ["blk.0.ffn_up_exps.weight", "blk.1.ffn_down_exps.weight", "blk.0.attn_k.weight"]
    adapter = write_adapter(tmp_path / "e.gguf", random_lora(tiny_qwen3moe, targets, 4, seed=24), arch="qwen3moe")
    runner = ModelRunner.from_paths(tiny_qwen3moe.path, [adapter], TEST_DEVICE)
    uncached = run(runner, None, adapters={0: 1.0})
    first = run(runner, open_cache(runner, redis_prefix), adapters={0: 1.0})
    second = run(runner, open_cache(runner, redis_prefix), adapters={0: 1.0})
    base = run(runner, open_cache(runner, redis_prefix))
    assert (first.cached_tokens, second.cached_tokens, base.cached_tokens) == (0, 40, 0)
    assert_same_output(second, uncached)
    assert base.token_ids != uncached.token_ids


def test_choices_share_a_cached_prefix_and_only_the_first_stores(runner, redis_prefix) -> None:
    """n = 3 after a cached prefix: the forks copy loaded and computed KV alike."""
    params = SamplingParams(max_tokens=6, temperature=1.0, top_k=0, seed=5, ignore_eos=True, logprobs=1, n=3)

    def choices(cache):
        engine = Engine(runner, None, EngineConfig(num_seq_slots=4, slot_len=128, max_step_tokens=16), prefix_cache=cache)
        engine.add_request(EngineRequest("r", list(PROMPT), params, {0: 1.0}, cache_salt="t1"))
        outs = []
        while engine.has_work():
            outs += engine.step()
        return engine, results_of(outs, "r")

    _, uncached = choices(None)
    cache = open_cache(runner, redis_prefix)
    choices(cache)
    assert cache.flush()
    stored = len(redis_values(redis_prefix))
    assert stored == (len(PROMPT) + params.max_tokens - 1) // C  # choice 0 stores its chunks; the forks store none
    engine, cached = choices(cache)
    assert engine.counters.prompt_tokens == len(PROMPT) - 40
    for i in range(3):
        assert cached[i].cached_tokens == 40
        assert_same_output(cached[i], uncached[i])
