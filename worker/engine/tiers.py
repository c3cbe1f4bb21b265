"""The bookkeeping of a replica's adapter tiers (worker/engine/residency.py): an LRU whose entries
carry their bytes and keep their total, the tiers' counters, and what an adapter costs on the device."""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Collection, Iterator
from dataclasses import dataclass, field, replace
from typing import Generic, TypeVar

import torch

from cache.stats import Histogram
from worker.formats.adapter import LoRAAdapter

TIERS = ("device", "host", "disk", "store")
MAGNITUDE_ITEM_BYTES = 4  # a DoRA's magnitudes are float32 on the device (worker/lora/attach.py: device_halves)
LOAD_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
K = TypeVar("K")
V = TypeVar("V")


class ByteLRU(Generic[K, V]):
    """Entries least recently used first, each with its bytes; their total is kept as they change."""

    def __init__(self) -> None:
        self._entries: OrderedDict[K, tuple[V, int]] = OrderedDict()
        self.total = 0

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self) -> Iterator[K]:
        return iter(self._entries)

    def items(self) -> Iterator[tuple[K, V, int]]:
        """(key, value, bytes), least recently used first."""
        return ((key, value, nbytes) for key, (value, nbytes) in self._entries.items())

    def get(self, key: K) -> V | None:
        entry = self._entries.get(key)
        return None if entry is None else entry[0]

    def put(self, key: K, value: V, nbytes: int) -> None:
        """Add or replace `key`, as the most recently used."""
        self.pop(key)
        self._entries[key] = (value, nbytes)
        self.total += nbytes

    def touch(self, key: K) -> None:
        self._entries.move_to_end(key)

    def pop(self, key: K) -> V | None:
        entry = self._entries.pop(key, None)
        if entry is None:
            return None
        self.total -= entry[1]
        return entry[0]

    def trim(self, budget: int, keep: Collection[K] = ()) -> list[K]:
        """Drop the least recently used entries (not those in `keep`) until the total is within `budget`; the keys dropped."""
        dropped = []
        for key in list(self._entries):
            if self.total <= budget:
                break
            if key not in keep:
                self.pop(key)
                dropped.append(key)
        return dropped


@dataclass
class ResidencyStats:
    promotions: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TIERS[1:], 0))  # by the tier it came from
    evictions: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TIERS[:3], 0))  # by the tier it left
    load_s: dict[str, Histogram] = field(default_factory=lambda: {t: Histogram(LOAD_BUCKETS_S) for t in TIERS[1:]})
    waited: int = 0  # requests that waited for an adapter to come up
    recent_load_s: deque[float] = field(default_factory=lambda: deque(maxlen=10_000))  # the last promotions' times (benchmarks)

    def promoted(self, source: str, seconds: float) -> None:
        self.promotions[source] += 1
        self.load_s[source].observe(seconds)
        self.recent_load_s.append(seconds)


def closed(adapter: LoRAAdapter) -> LoRAAdapter:
    """What the runner keeps of `adapter` (its facts, not its open file: a replica may serve thousands)."""
    return replace(adapter, gguf=None, base=None)


def device_nbytes(adapter: LoRAAdapter, dtype: torch.dtype) -> int:
    """Bytes `adapter` takes on the device: its halves in `dtype` and a DoRA's magnitudes in float32 (what
    LoRAState.nbytes counts once there, and perhaps a little more: a target that is no matmul here is
    counted too)."""
    item = torch.empty((), dtype=dtype).element_size()
    halves = sum((pair.a.num_elements + pair.b.num_elements) * item for pair in adapter.pairs.values())
    return halves + sum(pair.m.num_elements * MAGNITUDE_ITEM_BYTES for pair in adapter.pairs.values() if pair.m is not None)
