"""gateway/policy/replan.py (pure): new pins while running, and pins moved by traffic."""

from __future__ import annotations

import pytest

from gateway.policy.placement import PlacementError
from gateway.policy.replan import place_new, rebalance


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
    traffic = {"hot": 90.0, "cold": 1.0, "mid": 9.0}
    changes = rebalance(placed, traffic, replicas, copies=2, capacity=2)  # a, b and c full: d has room for one
    assert changes["hot"] == ("a", "b", "d")
    assert len(changes["cold"]) == 2  # down to its redundancy, never below, making room on a full shard
    assert "mid" not in changes
    again = rebalance({**placed, **changes}, traffic, replicas, copies=2, capacity=2)
    assert "cold" not in again
    roomy = rebalance(placed, traffic, replicas, copies=2, capacity=8)
    assert len(roomy["hot"]) == 3 and "cold" not in roomy  # with room a spare copy stays: it absorbs the next shift
    cooled = {"was_hot": ("a", "b", "c"), "busy": ("a", "b", "c")}  # was_hot no longer asked for
    one_each = dict.fromkeys("abc", 1)
    assert rebalance(cooled, {"busy": 9.0}, one_each, copies=2, capacity=8) == {}  # not yet taken for cooled
    gives_back = rebalance(cooled, {"busy": 9.0}, one_each, copies=2, capacity=8, cooled={"was_hot"})
    assert gives_back == {"was_hot": ("a", "b")}  # back to its redundancy, never below
    assert rebalance({**cooled, **gives_back}, {"busy": 9.0}, one_each, copies=2, capacity=8, cooled={"was_hot"}) == {}
    assert rebalance(placed, {}, replicas, copies=2, capacity=8) == {}  # no traffic: nothing moves
    assert rebalance(placed, {"hot": 90.0}, replicas, copies=2, capacity=1).get("hot") is None  # no room: nothing moves


def test_a_replan_keeps_every_shard_within_its_bound_of_the_mean() -> None:
    """Copies are dropped only while the other holders stay within (1 + BALANCE_SLACK) x the mean,
    and a shard past it gets a copy of its hot adapter on one that stays within it."""
    from gateway.policy.replan import BALANCE_SLACK

    replicas = dict.fromkeys("abcdef", 1)
    placed = {"x": ("a", "b"), "y": ("a", "c"), "z": ("d", "e", "f"), "w": ("b", "c", "d", "e", "f")}
    traffic = {"x": 40.0, "y": 30.0, "z": 5.0, "w": 5.0}  # a carries 35 of 80: the mean is 13.3
    changes = rebalance(placed, traffic, replicas, copies=2, capacity=3)
    assert len(changes["x"]) == 3 and changes["x"][-1] in "def"  # x spreads to one of the idle shards
    held = {**placed, **changes}
    load = dict.fromkeys(replicas, 0.0)
    for a, shards in held.items():
        for s in shards:
            load[s] += traffic[a] / len(shards)
    assert max(load.values()) < 35.0
    tight = rebalance({"x": ("a", "b", "c")}, {"x": 30.0}, {"a": 1, "b": 1, "c": 1}, copies=1, capacity=1)
    assert tight == {} and 30.0 / 2 > (1 + BALANCE_SLACK) * 10.0  # dropping one would put the other two past the bound


def test_shards_asleep_count_for_redundancy_by_what_they_keep_and_take_no_traffic() -> None:
    """An autoscaled shard's replicas now (0 asleep, more while scaled up) carry traffic; what it keeps
    (min_replicas, at least 1) is what redundancy counts on."""
    asleep = {"s1": 0, "s2": 0, "s3": 0, "s4": 0}
    assert place_new(dict.fromkeys(asleep, 1), dict.fromkeys(asleep, 1), copies=2, capacity=8, now=asleep) == ("s1", "s2")
    now, kept = {"auto": 3, "fixed": 1}, {"auto": 1, "fixed": 1}  # auto scaled up, for now
    assert place_new({"auto": 1, "fixed": 1}, kept, copies=2, capacity=8, now=now) == ("auto", "fixed")
    placed, traffic = {"x": ("auto", "fixed"), "y": ("auto",), "z": ("fixed",)}, {"y": 3.0, "z": 1.0}
    assert rebalance(placed, traffic, now, copies=2, capacity=8, kept=kept, cooled={"x"}) == {}  # x keeps both
    assert rebalance(placed, traffic, now, copies=2, capacity=8, cooled={"x"}) == {"x": ("auto",)}  # on auto's 3 now
    # one replica serves in the whole fleet: an adapter asked for while its shard sleeps gets a copy there
    assert rebalance({"x": ("hot",), "y": ("warm",)}, {"x": 1.0, "y": 1.0}, {"hot": 0, "warm": 1, "cool": 0},
                     copies=1, capacity=8) == {"x": ("hot", "warm")}
