"""The engine's side of the prefix cache: which keys a request uses, its cached prefix
copied into its KV sequence slot before the step that first runs it, and its newly
completed whole chunks handed to the cache after each step (`PrefixKV`, beside the
engine's step rather than inside it).

Keys (docs/architecture.md#cache-keys): the adapter set is the request's non-zero scales without
its aLoRA, so base requests and every aLoRA on the same prompt share the
chunks before the activation index; nothing at or after it is looked up or
stored. A lookup covers whole chunks of all but the last prompt token (that
token's logits pick the first output token, so it is always computed).
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np
import torch

from cache.codec import ChunkKV
from cache.keys import cacheable_tokens, chunk_keys, model_id, next_key, root_key
from cache.prefix import ChunkGeometry, PrefixCache, PrefixCacheConfig
from worker.engine.runner import ModelRunner
from worker.engine.scheduler import Span
from worker.formats.fingerprint import adapter_set_fingerprint, base_fingerprint
from worker.lora.mapping import RequestAdapters
from worker.model.attention import KVCache

warnings.filterwarnings("ignore", message="The given NumPy array is not writable", category=UserWarning, module=__name__)
log = logging.getLogger(__name__)

# On a CPU device the cache's writer (and Redis, on the same machine) pause 4x as long as each write
# took: a 16-prompt burst's 47 MB of KV reach Redis at a fifth of a core over ~1 s, not beside the
# first decode steps, whose gap to the next token they made 2.3-4.7x a decode step (1.8-2.5x paced;
# `loraplex bench-serving`, 2 cores). On a GPU the writer has its own cores: no pause.
CPU_WRITE_PAUSE = 4.0


def cache_model_id(runner: ModelRunner, fingerprint_dir: str | None = None) -> str:
    return model_id(base_fingerprint(runner.base, fingerprint_dir), runner.config.weight_format, runner.config.dtype)


def chunk_geometry(runner: ModelRunner, chunk_tokens: int, fingerprint_dir: str | None = None) -> ChunkGeometry:
    hp = runner.hparams
    return ChunkGeometry(
        cache_model_id(runner, fingerprint_dir), runner.config.dtype, (hp.num_layers, hp.num_kv_heads, chunk_tokens, hp.head_dim)
    )


def open_prefix_cache(runner: ModelRunner, config: PrefixCacheConfig, client=None, fingerprint_dir: str | None = None) -> PrefixCache:
    if config.write_pause is None:
        config = replace(config, write_pause=CPU_WRITE_PAUSE if runner.config.torch_device.type == "cpu" else 0.0)
    return PrefixCache(config, chunk_geometry(runner, config.chunk_tokens, fingerprint_dir), client)


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


def request_root(runner: ModelRunner, model_id: str, adapters: RequestAdapters, salt: str) -> bytes:
    """The root key of a request's chain: its adapter set without the aLoRA (docs/architecture.md#alora)."""
    pairs = [(runner.adapters[slot].fingerprint, scale) for slot, scale in adapters.scales.items()]
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


def extract_chunks(kv: KVCache, seq_slot: int, first_chunk: int, num_chunks: int, geometry: ChunkGeometry) -> list[ChunkKV]:
    """Chunks `first_chunk..` of a sequence slot as host arrays [layers, kv_heads, C, head_dim] (one copy off the device)."""
    c = geometry.shape[2]
    start, end = first_chunk * c, (first_chunk + num_chunks) * c
    k, v = _host_view(kv.k[:, seq_slot, :, start:end]), _host_view(kv.v[:, seq_slot, :, start:end])
    return [
        ChunkKV(geometry.model_id, (first_chunk + i) * c, geometry.dtype, k[:, :, i * c : (i + 1) * c], v[:, :, i * c : (i + 1) * c])
        for i in range(num_chunks)
    ]


def _as_tensor(array: np.ndarray) -> torch.Tensor:
    """A view (no copy) of a host array (values from Redis are read-only; they are only read)."""
    if array.dtype == np.uint16:  # bfloat16 bits
        return torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(array)


def load_chunks(kv: KVCache, seq_slot: int, chunks: Sequence[ChunkKV]) -> None:
    """Write cached chunks (positions 0..) into a sequence slot: one copy per chunk, straight from the cached arrays."""
    for chunk in chunks:
        start, end = chunk.first_position, chunk.first_position + chunk.k.shape[2]
        kv.k[:, seq_slot, :, start:end].copy_(_as_tensor(chunk.k))
        kv.v[:, seq_slot, :, start:end].copy_(_as_tensor(chunk.v))


class PrefixKV:
    """One engine's use of a prefix cache: lookups (any thread), then per step the loads of
    newly admitted sequences' cached prefixes and the stores of newly computed chunks."""

    def __init__(self, cache: PrefixCache, runner: ModelRunner) -> None:
        if cache.geometry != chunk_geometry(runner, cache.chunk_tokens):
            raise ValueError("the prefix cache was opened for another model, weight format or dtype")
        self.cache, self.runner = cache, runner
        self._hits: dict[tuple[str, int], CacheHit] = {}  # sequence key -> chunks still to load, and its store cursor

    def lookup(self, prompt_ids: Sequence[int], adapters: RequestAdapters, salt: str, *, reuse: bool = True) -> CacheHit:
        """The request's cached prefix (thread-safe: call it off the engine's thread)."""
        root = request_root(self.runner, self.cache.geometry.model_id, adapters, salt)
        return lookup(self.cache, root, prompt_ids, adapters.activation, reuse=reuse)

    def track(self, key: tuple[str, int], hit: CacheHit) -> None:
        self._hits[key] = hit

    def forget(self, key: tuple[str, int]) -> None:
        self._hits.pop(key, None)

    def load(self, spans: Sequence[Span], kv: KVCache) -> None:
        """Copy newly admitted sequences' cached prefixes into their sequence slots."""
        for span in spans:
            hit = self._hits.get(span.seq.key)
            if hit is not None and hit.chunks:
                load_chunks(kv, span.seq.seq_slot, hit.chunks)
                hit.chunks = []

    def store(self, spans: Sequence[Span], kv: KVCache) -> None:
        """Hand each sequence's newly computed whole chunks to the cache (never fails a request)."""
        for span in spans:
            seq, hit = span.seq, self._hits.get(span.seq.key)
            if hit is None:
                continue
            first = hit.cursor.num_chunks
            keys = new_chunk_keys(hit.cursor, seq.token_ids, seq.num_computed, self.cache.chunk_tokens)
            if not keys:
                continue
            try:
                values = extract_chunks(kv, seq.seq_slot, first, len(keys), self.cache.geometry)
                self.cache.store(list(zip(keys, values)))
            except Exception:
                log.exception("request %s: could not store its KV in the prefix cache", seq.request_id)
                self.cache.count_store_error(len(keys))
                self.forget(seq.key)
