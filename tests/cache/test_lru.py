"""The byte-bounded LRU (cache/lru.py): the worker-local tier of the prefix cache, and the adapter tiers."""

from __future__ import annotations

import pytest

from cache.lru import LRUBytes


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


def test_without_a_bound_the_owner_trims_keeping_what_it_names() -> None:
    lru: LRUBytes[str, int] = LRUBytes()
    for i, key in enumerate("abcd"):
        assert lru.put(key, i, nbytes=10)
    assert lru.num_bytes == 40 and list(lru) == ["a", "b", "c", "d"]
    assert lru.peek("a") == 0 and list(lru) == ["a", "b", "c", "d"]  # peek leaves the order
    assert lru.get("a") == 0 and list(lru) == ["b", "c", "d", "a"]
    assert lru.trim(20, keep={"b"}) == ["c", "d"]  # b is kept: the next least recent go
    assert list(lru.items()) == [("b", 1, 10), ("a", 0, 10)] and lru.num_evictions == 2
    assert lru.trim(0, keep={"b", "a"}) == [] and lru.num_bytes == 20  # only kept ones left: over the budget
    assert lru.pop("b") == 1 and lru.pop("b") is None and lru.num_bytes == 10
