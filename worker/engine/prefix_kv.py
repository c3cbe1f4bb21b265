"""The engine's side of the prefix cache: which keys a request uses, and moving
chunks of K/V between a KV slot and the cache's host arrays.

Keys (SPEC §4, §5): the adapter set is the request's non-zero scales without
its aLoRA, so base requests and every aLoRA on the same prompt share the
chunks before the activation index; nothing at or after it is looked up or
stored. A lookup covers whole chunks of all but the last prompt token (that
token's logits pick the first output token, so it is always computed).
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from cache.codec import ChunkKV
from cache.keys import cacheable_tokens, chunk_keys, model_id, next_key, root_key
from cache.prefix import ChunkGeometry, PrefixCache, PrefixCacheConfig
from worker.model.attention import KVCache
from worker.formats.fingerprint import adapter_set_fingerprint, base_fingerprint
from worker.engine.runner import ModelRunner

warnings.filterwarnings("ignore", message="The given NumPy array is not writable", category=UserWarning, module=__name__)


def cache_model_id(runner: ModelRunner) -> str:
    return model_id(base_fingerprint(runner.base), runner.config.weight_format, runner.config.dtype)


def chunk_geometry(runner: ModelRunner, chunk_tokens: int) -> ChunkGeometry:
    hp = runner.hparams
    return ChunkGeometry(cache_model_id(runner), runner.config.dtype, (hp.num_layers, hp.num_kv_heads, chunk_tokens, hp.head_dim))


def open_prefix_cache(runner: ModelRunner, config: PrefixCacheConfig, client=None) -> PrefixCache:
    return PrefixCache(config, chunk_geometry(runner, config.chunk_tokens), client)


@dataclass
class CacheCursor:
    """Where one request stands with the cache: the key of its last chunk in the
    cache, how many chunks that is, and where caching must stop (aLoRA)."""

    previous_key: bytes  # the root, or the key of chunk num_chunks - 1
    num_chunks: int
    limit: int | None  # the aLoRA activation index: tokens from here on are never cached


@dataclass
class CacheHit:
    """A lookup's result: the chunks to load (positions 0..), and the cursor after them."""

    cursor: CacheCursor
    chunks: list[ChunkKV]

    @property
    def num_tokens(self) -> int:
        return sum(c.k.shape[2] for c in self.chunks)


def request_root(runner: ModelRunner, model_id: str, adapters: Mapping[int, float], salt: str) -> bytes:
    pairs = [(runner.adapters[slot].fingerprint, scale) for slot, scale in adapters.items() if scale != 0 and not runner.adapters[slot].is_alora]
    return root_key(model_id, adapter_set_fingerprint(model_id, pairs), salt)


def lookup(cache: PrefixCache, root: bytes, prompt_ids: Sequence[int], alora_activation: int | None, *, reuse: bool = True) -> CacheHit:
    """The longest cached prefix of whole chunks (none when `reuse` is off: the request only stores)."""
    c = cache.chunk_tokens
    keys = chunk_keys(root, prompt_ids, c, cacheable_tokens(len(prompt_ids) - 1, c, alora_activation)) if reuse else []
    chunks = cache.lookup(keys) if keys else []
    previous = keys[len(chunks) - 1] if chunks else root
    return CacheHit(CacheCursor(previous, len(chunks), alora_activation), chunks)


def new_chunk_keys(cursor: CacheCursor, token_ids: Sequence[int], num_computed: int, chunk_tokens: int) -> list[bytes]:
    """Keys of the whole chunks computed since the cursor (advancing it)."""
    end = cacheable_tokens(num_computed, chunk_tokens, cursor.limit)
    keys = []
    for start in range(cursor.num_chunks * chunk_tokens, end, chunk_tokens):
        cursor.previous_key = next_key(cursor.previous_key, token_ids[start : start + chunk_tokens])
        keys.append(cursor.previous_key)
    cursor.num_chunks += len(keys)
    return keys


def _host_view(t: torch.Tensor) -> np.ndarray:
    t = t.detach().to("cpu").contiguous()
    if t.dtype == torch.bfloat16:  # numpy has no bfloat16: its raw bits
        return t.view(torch.int16).numpy().view(np.uint16)
    return t.numpy()


def extract_chunks(kv: KVCache, slot: int, first_chunk: int, num_chunks: int, geometry: ChunkGeometry) -> list[ChunkKV]:
    """Chunks `first_chunk..` of a slot as host arrays [layers, kv_heads, C, head_dim] (one copy off the device)."""
    c = geometry.shape[2]
    start, end = first_chunk * c, (first_chunk + num_chunks) * c
    k, v = _host_view(kv.k[:, slot, :, start:end]), _host_view(kv.v[:, slot, :, start:end])
    return [
        ChunkKV(geometry.model_id, (first_chunk + i) * c, geometry.dtype, k[:, :, i * c : (i + 1) * c], v[:, :, i * c : (i + 1) * c])
        for i in range(num_chunks)
    ]


def _as_tensor(array: np.ndarray) -> torch.Tensor:
    """A view (no copy) of a host array (values from Redis are read-only; they are only read)."""
    if array.dtype == np.uint16:  # bfloat16 bits
        return torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(array)


def load_chunks(kv: KVCache, slot: int, chunks: Sequence[ChunkKV]) -> None:
    """Write cached chunks (positions 0..) into a slot: one copy per chunk, straight from the cached arrays."""
    for chunk in chunks:
        start, end = chunk.first_position, chunk.first_position + chunk.k.shape[2]
        kv.k[:, slot, :, start:end].copy_(_as_tensor(chunk.k))
        kv.v[:, slot, :, start:end].copy_(_as_tensor(chunk.v))
