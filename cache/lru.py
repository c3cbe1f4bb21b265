"""An LRU bounded by bytes (torch-free): entries least recently used first, each charged its bytes,
their total kept as they change.

With `max_bytes`, a `put` drops the least recently used entries past it (the prefix cache's
worker-local tier, cache/prefix.py). Without, the owner trims it to a budget of its own choosing,
keeping the entries it names (a replica's adapter tiers, worker/residency/).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Iterable, Iterator
from typing import Generic, TypeVar

K = TypeVar("K")
V = TypeVar("V")


class LRUBytes(Generic[K, V]):
    def __init__(self, max_bytes: int | None = None) -> None:
        if max_bytes is not None and max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        self.max_bytes = max_bytes  # None: no bound but the owner's `trim`
        self.num_bytes = 0
        self.num_evictions = 0  # entries dropped for room (by `put` or `trim`)
        self._items: OrderedDict[K, tuple[V, int]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, key: object) -> bool:
        return key in self._items

    def __iter__(self) -> Iterator[K]:
        """Keys, least recently used first."""
        return iter(self._items)

    def items(self) -> Iterator[tuple[K, V, int]]:
        """(key, value, bytes), least recently used first."""
        return ((key, value, nbytes) for key, (value, nbytes) in self._items.items())

    def get(self, key: K) -> V | None:
        """The value, made the most recently used."""
        item = self._items.get(key)
        if item is None:
            return None
        self._items.move_to_end(key)
        return item[0]

    def peek(self, key: K) -> V | None:
        """The value, without making it the most recent."""
        item = self._items.get(key)
        return None if item is None else item[0]

    def get_many(self, keys: Iterable[K]) -> list[V | None]:
        return [self.get(k) for k in keys]

    def put(self, key: K, value: V, nbytes: int | None = None) -> bool:
        """Add or replace `key` as the most recently used, charged `nbytes` (default: `len(value)`);
        False, and nothing stored, when the value alone exceeds `max_bytes`."""
        size = len(value) if nbytes is None else nbytes
        if self.max_bytes is not None and size > self.max_bytes:
            return False
        self.pop(key)
        self._items[key] = (value, size)
        self.num_bytes += size
        if self.max_bytes is not None:
            self.trim(self.max_bytes)
        return True

    def pop(self, key: K) -> V | None:
        """Remove `key`: its value, or None when it was not there."""
        item = self._items.pop(key, None)
        if item is None:
            return None
        self.num_bytes -= item[1]
        return item[0]

    def delete(self, key: K) -> None:
        self.pop(key)

    def trim(self, max_bytes: int, keep: Collection[K] = ()) -> list[K]:
        """Drop the least recently used entries, not those in `keep`, until the total is within
        `max_bytes` (or only kept ones are left); the keys dropped."""
        over, dropped = self.num_bytes - max_bytes, []
        for key, (_, nbytes) in self._items.items():
            if over <= 0:
                break
            if key not in keep:
                dropped.append(key)
                over -= nbytes
        for key in dropped:
            self.pop(key)
        self.num_evictions += len(dropped)
        return dropped
