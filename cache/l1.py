"""The worker-local tier: chunk values in an LRU bounded by bytes (torch-free).

Values are whatever the caller keeps (encoded bytes, or decoded chunks); each
is charged its `nbytes` (default: `len(value)`).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from typing import Any


class LRUBytes:
    def __init__(self, max_bytes: int) -> None:
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        self.max_bytes = max_bytes
        self.num_bytes = 0
        self.num_evictions = 0
        self._items: OrderedDict[bytes, tuple[Any, int]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, key: bytes) -> bool:
        return key in self._items

    def get(self, key: bytes) -> Any | None:
        item = self._items.get(key)
        if item is None:
            return None
        self._items.move_to_end(key)
        return item[0]

    def peek(self, key: bytes) -> Any | None:
        """The value, without making it the most recent."""
        item = self._items.get(key)
        return None if item is None else item[0]

    def get_many(self, keys: Iterable[bytes]) -> list[Any | None]:
        return [self.get(k) for k in keys]

    def put(self, key: bytes, value: Any, nbytes: int | None = None) -> bool:
        """Store (most recent); False when the value alone exceeds the budget."""
        size = len(value) if nbytes is None else nbytes
        if size > self.max_bytes:
            return False
        self.delete(key)
        self._items[key] = (value, size)
        self.num_bytes += size
        while self.num_bytes > self.max_bytes:
            _, (_, old_size) = self._items.popitem(last=False)
            self.num_bytes -= old_size
            self.num_evictions += 1
        return True

    def delete(self, key: bytes) -> None:
        old = self._items.pop(key, None)
        if old is not None:
            self.num_bytes -= old[1]
