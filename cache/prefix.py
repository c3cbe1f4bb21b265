"""The prefix cache: an L1 in the worker over an optional shared L2 in Redis (torch-free).

`lookup` returns the longest run of a prompt's chunks, in order, that the
tiers hold: L1 first, then one MGET for the keys after L1's run. Every L2
value is verified (checksum, format version, model, dtype, shape, position);
one that fails is a miss, is counted, and is deleted in the background. The
chain of keys makes a chunk useless without all the ones before it, so the run
stops at the first miss.

`store` puts new chunks in L1 at once and hands them to a writer thread that
encodes them and writes them to Redis, so neither the engine's step nor a
lookup ever waits on a write; when the writer falls behind, writes are
dropped and counted, never queued without bound.

An L1 entry remembers whether Redis has it. One that could not be written
(Redis down, writer behind), that predates a Redis outage (the server may have
restarted empty), or that was last written more than half a TTL ago is
written again, in the background, the next time this worker serves it: what
one worker keeps serving stays shared, and hot prefixes never expire in Redis
while they are in use.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from cache.codec import ChunkKV, CorruptValue, decode, encode
from cache.keys import DEFAULT_CHUNK_TOKENS
from cache.lru import LRUBytes
from cache.l2 import RedisConfig, RedisTier
from cache.stats import CacheStats, prometheus_text

log = logging.getLogger(__name__)

MAX_WRITE_PAUSE_S = 0.2


@dataclass(frozen=True)
class PrefixCacheConfig:
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS
    l1_bytes: int = 1 << 30
    redis: RedisConfig | None = None  # None: this worker's L1 only
    max_pending_writes: int = 4096  # chunks waiting for the Redis writer; beyond: dropped, counted
    # After each write the writer waits this many times as long as the write took (at most
    # MAX_WRITE_PAUSE_S; flush and close cut it short). A burst's megabytes of KV then reach Redis
    # over the next few steps instead of all beside the first one: on a CPU engine the writer and
    # Redis take their cores from the engine's compute threads. None: the engine's choice
    # (worker/engine/prefix_kv.py: 4 on a CPU device, 0 elsewhere); here, 0.
    write_pause: float | None = None

    def __post_init__(self) -> None:
        if self.chunk_tokens < 1:
            raise ValueError(f"chunk_tokens must be >= 1, got {self.chunk_tokens}")
        if self.l1_bytes < 0 or self.max_pending_writes < 1 or (self.write_pause or 0) < 0:
            raise ValueError("l1_bytes and write_pause must be >= 0 and max_pending_writes >= 1")


@dataclass(frozen=True)
class ChunkGeometry:
    """What every value of this worker's model must look like."""

    model_id: str  # base fingerprint + weight format + KV dtype: KV from another numeric path never mixes in
    dtype: str
    shape: tuple[int, int, int, int]  # [layers, kv_heads, chunk_tokens, head_dim]


@dataclass(eq=False)
class _Entry:
    chunk: ChunkKV
    nbytes: int = field(init=False)
    shared_epoch: int | None = None  # the tier's recovery count when Redis last got it; None: not known to
    shared_s: float = 0.0
    is_queued: bool = False  # a write of it is waiting for the writer

    def __post_init__(self) -> None:
        self.nbytes = self.chunk.k.nbytes + self.chunk.v.nbytes


class PrefixCache:
    def __init__(
        self, config: PrefixCacheConfig, geometry: ChunkGeometry, client=None, clock: Callable[[], float] = time.perf_counter
    ) -> None:
        if geometry.shape[2] != config.chunk_tokens:
            raise ValueError(f"chunk geometry has {geometry.shape[2]} tokens, config says {config.chunk_tokens}")
        self.config, self.geometry = config, geometry
        self.chunk_tokens = config.chunk_tokens
        self.stats = CacheStats()
        self.l1 = LRUBytes(config.l1_bytes)
        self.tier: RedisTier | None = None
        if config.redis is not None:
            self.tier = RedisTier(client, config.redis)  # client None: the tier connects at first use
        self._clock = clock
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._num_pending = 0  # chunks queued or being written
        self._writes: queue.Queue[tuple[str, list] | None] = queue.Queue()
        self._hurry = threading.Event()  # set while someone waits for the writes: no pauses
        self._num_flushing = 0
        self._writer: threading.Thread | None = None
        if self.tier is not None:
            self._writer = threading.Thread(target=self._write_loop, name="loraplex-cache-writer", daemon=True)
            self._writer.start()

    # reads

    def lookup(self, keys: Sequence[bytes]) -> list[ChunkKV]:
        """The cached chunks for `keys[0], keys[1], ...` up to the first one missing."""
        started = self._clock()
        found: list[ChunkKV] = []
        reshare: list[tuple[bytes, ChunkKV]] = []
        with self._lock:
            for key in keys:
                entry = self.l1.get(key)
                if entry is None:
                    break
                found.append(entry.chunk)
                if self._needs_sharing(entry, started):
                    entry.is_queued = True
                    reshare.append((key, entry.chunk))
        num_l1, num_bytes, corrupt, from_l2 = len(found), 0, [], []
        rest = keys[num_l1:]
        if rest and self.tier is not None:
            for key, blob in zip(rest, self.tier.get_many(rest)):
                if blob is None:
                    break
                try:
                    chunk = self._verify(blob, len(found))
                except CorruptValue as e:
                    log.warning("prefix cache: dropping a bad value %s: %s", self.tier.key(key), e)
                    corrupt.append(key)
                    break
                found.append(chunk)
                from_l2.append((key, chunk))
                num_bytes += len(blob)
        with self._lock:
            epoch = self.tier.num_recoveries if self.tier is not None else None
            for key, chunk in from_l2:
                self._put_l1(key, _Entry(chunk, shared_epoch=epoch, shared_s=started))
            s = self.stats
            s.num_lookups += 1
            s.num_lookups_hit += bool(found)
            s.num_chunks_hit_l1 += num_l1
            s.num_chunks_hit_l2 += len(from_l2)
            s.num_chunks_missed += len(keys) - len(found)
            s.num_tokens_hit += len(found) * self.chunk_tokens
            s.num_bytes_read_l2 += num_bytes
            s.num_corrupt += len(corrupt)
            s.lookup_s.observe(self._clock() - started)
        if corrupt:
            self._enqueue("delete", corrupt)
        if reshare:
            self._enqueue("put", reshare)
        return found

    def _needs_sharing(self, entry: _Entry, now_s: float) -> bool:
        tier = self.tier
        if tier is None or entry.is_queued or tier.is_degraded:
            return False
        return entry.shared_epoch != tier.num_recoveries or now_s - entry.shared_s > tier.config.ttl_s / 2

    def _put_l1(self, key: bytes, entry: _Entry) -> None:
        self.l1.put(key, entry, entry.nbytes)

    def _verify(self, blob: bytes, index: int) -> ChunkKV:
        g = self.geometry
        chunk = decode(blob, g.model_id)
        if chunk.dtype != g.dtype or tuple(chunk.k.shape) != g.shape:
            raise CorruptValue(f"value is {chunk.dtype} {tuple(chunk.k.shape)}, this worker needs {g.dtype} {g.shape}")
        if chunk.first_position != index * self.chunk_tokens:
            raise CorruptValue(f"value starts at position {chunk.first_position}, expected {index * self.chunk_tokens}")
        return chunk

    # writes

    def store(self, items: Sequence[tuple[bytes, ChunkKV]]) -> None:
        """Keep new chunks in L1 now; write them to Redis in the background."""
        if not items:
            return
        with self._lock:
            for key, chunk in items:
                self._put_l1(key, _Entry(chunk, is_queued=self.tier is not None))
            self.stats.num_chunks_stored += len(items)
        if self.tier is not None:
            self._enqueue("put", list(items))

    def _enqueue(self, kind: str, payload: list) -> None:
        with self._lock:
            if self._num_pending + len(payload) > self.config.max_pending_writes:
                self.stats.num_writes_dropped += len(payload)
                if kind == "put":
                    self._mark_written(payload, None)
                return
            self._num_pending += len(payload)
        self._writes.put((kind, payload))

    def _mark_written(self, items: list[tuple[bytes, ChunkKV]], epoch: int | None) -> None:
        """Record (under the lock) whether Redis got these chunks; only entries still holding them."""
        now = self._clock()
        for key, chunk in items:
            entry = self.l1.peek(key)
            if entry is not None and entry.chunk is chunk:
                entry.is_queued, entry.shared_epoch, entry.shared_s = False, epoch, now

    def _write_loop(self) -> None:
        assert self.tier is not None
        while (item := self._writes.get()) is not None:
            kind, payload = item
            written = failed = 0
            began = time.perf_counter()
            try:
                if kind == "put":
                    blobs = {key: encode(chunk) for key, chunk in payload}
                    if self.tier.put_many(blobs):
                        written = sum(map(len, blobs.values()))
                else:
                    self.tier.delete_many(payload)
            except Exception:  # a bug in encoding, not Redis (the tier absorbs those): count it, keep writing
                log.exception("prefix cache: could not write %d chunk(s)", len(payload))
                failed = len(payload)
            with self._lock:
                if kind == "put":
                    self._mark_written(payload, self.tier.num_recoveries if written else None)
                self.stats.num_bytes_written_l2 += written
                self.stats.num_store_errors += failed
                self._num_pending -= len(payload)
                self._idle.notify_all()
            if self.config.write_pause:  # None or 0: none
                self._hurry.wait(min(self.config.write_pause * (time.perf_counter() - began), MAX_WRITE_PAUSE_S))

    def flush(self, timeout_s: float = 10.0) -> bool:
        """Wait until queued writes have reached Redis (or failed); False on timeout."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            self._num_flushing += 1
            self._hurry.set()
            try:
                while self._num_pending:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        return False
                    self._idle.wait(left)
            finally:
                self._num_flushing -= 1
                if not self._num_flushing:
                    self._hurry.clear()
        return True

    def close(self, timeout_s: float = 10.0) -> None:
        """Finish queued writes (up to `timeout_s`) and stop the writer."""
        if self._writer is None:
            return
        self.flush(timeout_s)
        self._hurry.set()
        self._writes.put(None)
        self._writer.join(timeout_s)
        self._writer = None

    # state

    def count_store_error(self, num_chunks: int) -> None:
        with self._lock:
            self.stats.num_store_errors += num_chunks

    @property
    def redis_state(self) -> str:
        """ok | degraded (the breaker is open: Redis is down or slow) | off (no Redis configured)."""
        if self.tier is None:
            return "off"
        return "degraded" if self.tier.is_degraded else "ok"

    def health(self) -> dict[str, object]:
        out: dict[str, object] = {"redis": self.redis_state, "l1_bytes": self.l1.num_bytes, "l1_chunks": len(self.l1)}
        if self.config.redis is not None:
            out["redis_url"] = self.config.redis.safe_url
        return out

    def prometheus(self) -> str:
        with self._lock:
            return prometheus_text(
                self.stats, l1_bytes=self.l1.num_bytes, redis_state=self.redis_state,
                redis_errors=self.tier.num_errors if self.tier else 0,
                redis_round_trips=self.tier.num_round_trips if self.tier else 0,
            )
