"""What keeps a replica's process within the bytes its tiers are budgeted: the adapters' reads and copies run
on a fixed pool of `READER_THREADS` threads, glibc keeps at most `MAX_ARENAS` malloc arenas, and the memory
that evictions free is handed back to the OS (`malloc_trim`) once `TRIM_AFTER_BYTES` have been evicted.

Why: glibc gives each thread that allocates an arena of its own (up to 8 per core), and the engine fixes
its trim threshold at 512 MiB (worker/model/host_memory.py: a pass's activations are kept for the next
one), so every arena may keep that much freed. Reads on the event loop's default executor (up to 32
threads, shared with everything else) spread thousands of adapters' temporary arrays over as many arenas,
each keeping what its reads freed, and an eviction frees an adapter's bytes into an arena that keeps them.
A fixed pool and a bounded arena count bound the first; the trim after evictions the second.

`rss_bytes` and `peak_rss_bytes` are the process's resident memory now and at its peak (Linux), which
bench/bench_tiers.py prints against the tiers' bytes. mallopt and malloc_trim are glibc's: elsewhere
(musl, macOS) the bound is the reader pool alone.
"""

from __future__ import annotations

import asyncio
import functools
import resource
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any, TypeVar

from worker.model.host_memory import glibc

READER_THREADS = 2  # reads, host halves and copies to the device; more only queue behind one another on a host's cores
MAX_ARENAS = 4  # the engine's thread, the readers, the event loop's: more arenas only hold more freed bytes
TRIM_AFTER_BYTES = 64 << 20  # evicted bytes between two malloc_trim calls (one walks every arena: ~ms)
IS_BOUNDED = True  # a replica's default; bench/bench_tiers.py's --no-memory-bound sets it off to compare
_M_ARENA_MAX = -8
T = TypeVar("T")


@functools.cache
def bound_arenas(max_arenas: int = MAX_ARENAS) -> bool:
    """Keep at most `max_arenas` malloc arenas in this process from now on (once); False without glibc."""
    libc = glibc()
    return libc is not None and bool(libc.mallopt(_M_ARENA_MAX, max_arenas))


def trim() -> bool:
    """Hand the free pages of every arena back to the OS; whether any was."""
    libc = glibc()
    return libc is not None and bool(libc.malloc_trim(0))


class HostMemory:
    """A replica's bound on its process memory: the reader pool, and evicted bytes counted up to a trim.
    `is_bounded` False: the default executor and no trim (bench/bench_tiers.py's side-by-side)."""

    def __init__(self, is_bounded: bool | None = None, num_readers: int = READER_THREADS) -> None:
        self.is_bounded = is_bounded = IS_BOUNDED if is_bounded is None else is_bounded
        self.readers = ThreadPoolExecutor(num_readers, thread_name_prefix="residency-read") if is_bounded else None
        self.num_trims = 0
        self.trim_s = 0.0  # their total time (bench/bench_tiers.py prints it)
        self._trimmed_at_bytes = 0  # the evicted bytes counted at the last trim
        self._guard = threading.Lock()
        if is_bounded:
            bound_arenas()

    def settle(self, evicted_bytes: int) -> bool:
        """`evicted_bytes`: the bytes of adapters that have left a tier in host memory so far (the host tier,
        and a CPU's device). Past `TRIM_AFTER_BYTES` more since the last trim, trim now (on the caller's
        thread: a reader); whether it did."""
        if not self.is_bounded:
            return False
        with self._guard:
            if evicted_bytes - self._trimmed_at_bytes < TRIM_AFTER_BYTES:
                return False
            self._trimmed_at_bytes = evicted_bytes
            self.num_trims += 1
        started = time.perf_counter()
        trim()
        self.trim_s += time.perf_counter() - started
        return True

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)` on a reader (bounded) or the event loop's default executor."""
        return await asyncio.get_running_loop().run_in_executor(self.readers, partial(fn, *args))

    def close(self) -> None:
        if self.readers is not None:
            self.readers.shutdown(wait=False, cancel_futures=True)


def _status_bytes(field: str) -> int | None:
    """A `/proc/self/status` memory line (`VmRSS:`, `VmHWM:`) in bytes; None where there is none (not Linux)."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith(field):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def rss_bytes() -> int:
    """This process's resident memory now (Linux; 0 elsewhere)."""
    return _status_bytes("VmRSS:") or 0


def peak_rss_bytes() -> int:
    """This process's peak resident memory: Linux's VmHWM, the high-water mark of this program's own memory.
    Not ru_maxrss there: it outlives exec, so a process started from a large one (a test run's subprocess)
    reports its parent's peak. Elsewhere ru_maxrss (bytes on macOS)."""
    hwm = _status_bytes("VmHWM:")
    if hwm is not None:
        return max(hwm, rss_bytes())
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024
