"""Prefix-cache keys and values: pure logic, no Redis."""

from __future__ import annotations

import numpy as np
import pytest

from cache import keys as keys_module
from cache.codec import ChunkKV, CorruptValue, decode, encode
from cache.keys import cacheable_tokens, chunk_keys, model_id, redis_key, root_key

TOKENS = list(range(100, 200))


def test_keys_chain_over_whole_chunks_only() -> None:
    root = root_key("base", "set", "tenant-a")
    keys = chunk_keys(root, TOKENS, 32)
    assert len(keys) == 3 and len(set(keys)) == 3  # 100 tokens: 3 whole chunks of 32
    assert chunk_keys(root, TOKENS, 32) == keys  # deterministic
    assert chunk_keys(root, TOKENS[:70], 32) == keys[:2]  # a growing prompt reuses its prefix keys
    changed = TOKENS.copy()
    changed[5] += 1
    assert not set(chunk_keys(root, changed, 32)) & set(keys)  # a change in chunk 0 changes every later key
    changed = TOKENS.copy()
    changed[40] += 1
    assert chunk_keys(root, changed, 32)[0] == keys[0] and chunk_keys(root, changed, 32)[1] != keys[1]


def test_cache_keys_have_their_own_version(monkeypatch) -> None:
    from worker.formats import fingerprint

    def all_keys() -> list[bytes]:
        return [model_id("base", "f16", "float32").encode(), *chunk_keys(root_key("base", "set", "t"), TOKENS, 32)]

    before = all_keys()
    monkeypatch.setattr(fingerprint, "FINGERPRINT_VERSION", fingerprint.FINGERPRINT_VERSION + 1)
    assert all_keys() == before  # a new adapter-fingerprint version alone does not touch the cache's keys
    monkeypatch.setattr(keys_module, "CACHE_KEY_VERSION", keys_module.CACHE_KEY_VERSION + 1)
    assert not set(all_keys()) & set(before)
    monkeypatch.undo()
    monkeypatch.setattr(keys_module, "VALUE_FORMAT_VERSION", keys_module.VALUE_FORMAT_VERSION + 1)
    assert all_keys()[1:] != before[1:]  # a new value format never looks up the old values


def test_every_root_field_separates_keys() -> None:
    roots = {root_key("base", "set", "a"), root_key("base2", "set", "a"), root_key("base", "set2", "a"), root_key("base", "set", "b"),
             root_key("bases", "et", "a"), root_key("base", "seta", "")}
    assert len(roots) == 6  # fields are tagged and length-prefixed: no shifting collisions
    assert len({chunk_keys(r, TOKENS, 32)[0] for r in roots}) == 6


def test_token_boundaries_cannot_collide() -> None:
    root = root_key("b", "s", "t")
    assert chunk_keys(root, [1, 23], 2) != chunk_keys(root, [12, 3], 2)
    assert chunk_keys(root, [2**32 - 1, 0], 2) != chunk_keys(root, [0, 2**32 - 1], 2)


def test_alora_caches_only_chunks_before_activation() -> None:
    assert cacheable_tokens(100, 32) == 96
    assert cacheable_tokens(100, 32, alora_activation=70) == 64
    assert cacheable_tokens(100, 32, alora_activation=20) == 0
    root = root_key("base", "set-without-the-alora", "t")
    assert len(chunk_keys(root, TOKENS, 32, limit=cacheable_tokens(100, 32, 70))) == 2
    assert redis_key("lp", b"\x01\xff") == "lp:kv:01ff"
    with pytest.raises(ValueError):
        chunk_keys(root, TOKENS, 0)


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_value_round_trip(dtype) -> None:
    rng = np.random.default_rng(0)
    raw = np.uint16 if dtype == "bfloat16" else np.dtype(dtype)
    k = rng.integers(0, 2**15, (3, 2, 32, 8)).astype(raw) if dtype == "bfloat16" else rng.standard_normal((3, 2, 32, 8)).astype(raw)
    v = k[::-1].copy()
    chunk = ChunkKV("model-fp", 64, dtype, k, v)
    back = decode(encode(chunk), "model-fp")
    assert back.first_position == 64 and back.dtype == dtype
    np.testing.assert_array_equal(back.k, k)
    np.testing.assert_array_equal(back.v, v)


def test_corrupt_values_are_refused() -> None:
    k = np.ones((2, 1, 4, 4), np.float32)
    blob = encode(ChunkKV("model-fp", 0, "float32", k, k * 2))
    flipped = bytearray(blob)
    flipped[len(blob) // 2] ^= 1
    for bad in (bytes(flipped), blob[:-1], blob[:10], b"", b"XXXX" + blob[4:]):
        with pytest.raises(CorruptValue):
            decode(bad, "model-fp")
    with pytest.raises(CorruptValue, match="another model"):
        decode(blob, "other-model")
