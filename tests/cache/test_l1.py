"""The worker-local LRU tier."""

from __future__ import annotations

import pytest

from cache.l1 import LRUBytes


def test_least_recently_used_goes_first_within_the_byte_budget() -> None:
    lru = LRUBytes(max_bytes=10)
    assert lru.put(b"a", b"1234") and lru.put(b"b", b"1234")
    assert lru.get(b"a") == b"1234"  # a is now the most recent
    lru.put(b"c", b"1234")  # 12 bytes > 10: b goes
    assert lru.get_many([b"a", b"b", b"c"]) == [b"1234", None, b"1234"]
    assert lru.num_bytes == 8 and lru.num_evictions == 1 and len(lru) == 2


def test_replacing_and_deleting_keep_the_byte_count() -> None:
    lru = LRUBytes(max_bytes=10)
    lru.put(b"a", b"12345")
    lru.put(b"a", b"12")
    assert lru.num_bytes == 2 and lru.get(b"a") == b"12"
    lru.delete(b"a")
    lru.delete(b"missing")
    assert lru.num_bytes == 0 and len(lru) == 0


def test_a_value_larger_than_the_budget_is_not_stored() -> None:
    lru = LRUBytes(max_bytes=3)
    lru.put(b"x", b"1")
    assert not lru.put(b"big", b"1234")
    assert lru.get(b"x") == b"1" and lru.get(b"big") is None
    assert LRUBytes(0).put(b"k", b"v") is False
    with pytest.raises(ValueError):
        LRUBytes(-1)
