"""The worker-local tier: encoded chunk values in an LRU bounded by bytes (torch-free)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable


class LRUBytes:
    def __init__(self, max_bytes: int) -> None:
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        self.max_bytes = max_bytes
        self.num_bytes = 0
        self.num_evictions = 0
        self._items: OrderedDict[bytes, bytes] = OrderedDict()

    def __len__(self) -> int:
        return len(self._items)

    def get(self, key: bytes) -> bytes | None:
        value = self._items.get(key)
        if value is not None:
            self._items.move_to_end(key)
        return value

    def get_many(self, keys: Iterable[bytes]) -> list[bytes | None]:
        return [self.get(k) for k in keys]

    def put(self, key: bytes, value: bytes) -> bool:
        """Store (most recent); False when the value alone exceeds the budget."""
        if len(value) > self.max_bytes:
            return False
        self.delete(key)
        self._items[key] = value
        self.num_bytes += len(value)
        while self.num_bytes > self.max_bytes:
            _, old = self._items.popitem(last=False)
            self.num_bytes -= len(old)
            self.num_evictions += 1
        return True

    def delete(self, key: bytes) -> None:
        old = self._items.pop(key, None)
        if old is not None:
            self.num_bytes -= len(old)
