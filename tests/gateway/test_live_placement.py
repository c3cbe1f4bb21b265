"""Placement while running (pure): new pins, and pins moved by traffic."""

from __future__ import annotations

import pytest

from gateway.policy.placement import PlacementError, place_new, rebalance


def test_a_new_adapter_goes_to_the_emptiest_shards_until_it_has_its_copies() -> None:
    replicas = {"a": 1, "b": 1, "c": 2}
    assert place_new({"a": 5, "b": 2, "c": 3}, replicas, copies=2, capacity=10) == ("b", "c")
    # two replicas already
    assert place_new({"a": 1, "b": 2, "c": 3}, {"a": 2, "b": 1, "c": 1}, copies=2, capacity=10) == ("a",)
    # as many copies as there is room for
    assert place_new({"a": 10, "b": 9, "c": 10}, replicas, copies=2, capacity=10) == ("b",)
    with pytest.raises(PlacementError, match="limit of 10 adapters"):
        place_new({"a": 10, "b": 10, "c": 10}, replicas, copies=2, capacity=10)


def test_a_hot_adapter_gains_a_shard_and_a_cold_one_gives_back_its_extra() -> None:
    replicas = {"a": 1, "b": 1, "c": 1, "d": 1}
    placed = {"hot": ("a", "b"), "cold": ("a", "b", "c"), "mid": ("c", "d")}
    changes = rebalance(placed, {"hot": 90.0, "cold": 1.0, "mid": 9.0}, replicas, copies=2, capacity=8)
    assert len(changes["hot"]) == 3 and set(changes["hot"]) > {"a", "b"}
    assert len(changes["cold"]) == 2  # down to its redundancy, never below
    assert "mid" not in changes
    again = rebalance({**placed, **changes}, {"hot": 90.0, "cold": 1.0, "mid": 9.0}, replicas, copies=2, capacity=8)
    assert "cold" not in again
    assert rebalance(placed, {}, replicas, copies=2, capacity=8) == {}  # no traffic: nothing moves
    assert rebalance(placed, {"hot": 90.0}, replicas, copies=2, capacity=1).get("hot") is None  # no room: nothing moves
