"""Prefix-cache keys (docs/architecture.md#cache-keys), torch-free.

Chunk `i` of a prompt is keyed by a chain: `h_-1 = H(version, base fp,
adapter-set fp, tenant salt)`, `h_i = H(h_{i-1}, tokens[iC:(i+1)C])`. A key
therefore names the whole prefix up to its chunk, under exactly one model,
adapter set (scales included) and tenant. Only whole chunks are keyed; for an
aLoRA request only chunks wholly before its activation index, under the set
without the aLoRA (worker/formats/alora.py), so base requests share them.

`CACHE_KEY_VERSION` belongs to these keys alone (a new adapter fingerprint
version does not change them by itself); the root also covers the value
format's version, so a new format never looks up values of the old one.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

from cache.hashing import TaggedHasher

CACHE_KEY_VERSION = 1
VALUE_FORMAT_VERSION = 1  # of the values (cache/codec.py)
DEFAULT_CHUNK_TOKENS = 32


def model_id(base_fingerprint: str, weight_format: str, dtype: str) -> str:
    """The base model plus what changes the numbers in its KV: weight format and KV dtype."""
    h = TaggedHasher("loraplex.cache.model", CACHE_KEY_VERSION)
    h.text("base", base_fingerprint)
    h.text("weights", weight_format)
    h.text("dtype", dtype)
    return h.hexdigest()


def root_key(base_fingerprint: str, adapter_set_fingerprint: str, salt: str) -> bytes:
    h = TaggedHasher("loraplex.cache.root", CACHE_KEY_VERSION)
    h.integer("format", VALUE_FORMAT_VERSION)
    h.text("base", base_fingerprint)
    h.text("adapter_set", adapter_set_fingerprint)
    h.text("salt", salt)
    return h.digest_bytes()


def cacheable_tokens(num_tokens: int, chunk_tokens: int, alora_activation: int | None = None) -> int:
    """Tokens covered by whole chunks, stopping before an aLoRA's activation index."""
    limit = num_tokens if alora_activation is None else min(num_tokens, alora_activation)
    return limit - limit % chunk_tokens


def chunk_keys(root: bytes, tokens: Sequence[int], chunk_tokens: int = DEFAULT_CHUNK_TOKENS, limit: int | None = None) -> list[bytes]:
    """Keys of the whole chunks of `tokens[:limit]`, in order."""
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    end = len(tokens) if limit is None else min(limit, len(tokens))
    keys, previous = [], root
    for start in range(0, end - end % chunk_tokens, chunk_tokens):
        previous = next_key(previous, tokens[start : start + chunk_tokens])
        keys.append(previous)
    return keys


def next_key(previous: bytes, chunk: Sequence[int]) -> bytes:
    """The key of the chunk after `previous` (the root, or the key of the chunk before)."""
    h = TaggedHasher("loraplex.cache.chunk", CACHE_KEY_VERSION)
    h.raw("previous", previous)
    h.raw("tokens", struct.pack(f"<{len(chunk)}I", *chunk))
    return h.digest_bytes()


def redis_key(prefix: str, key: bytes) -> str:
    return f"{prefix}:kv:{key.hex()}"
