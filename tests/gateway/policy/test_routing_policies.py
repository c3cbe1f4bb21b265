"""The routing policies one by one, over hand-built snapshots (no cluster), and the registry
that maps the config's `routing.policy` to them."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from gateway.policy.routing import (
    POLICIES,
    AffinityPolicy,
    LeastLoadedPolicy,
    NoCandidateError,
    RandomPolicy,
    ReplicaView,
    RouteRequest,
    RoutingSettings,
    affinity_key,
    choose,
)
from gateway.policy.routing import registry as registry_module


def pool(in_flight: dict[str, int], recent: dict[str, float] | None = None) -> list[ReplicaView]:
    return [ReplicaView(rid, "s", frozenset({"x"}), n, recent=(recent or {}).get(rid, 0.0)) for rid, n in in_flight.items()]


KEYS = [affinity_key("set", [i] * 8, 8) for i in range(40)]


def test_least_loaded_takes_the_replica_with_fewest_in_flight_whatever_the_key() -> None:
    views = pool({"r0": 3, "r1": 0, "r2": 1, "r3": 5})
    assert {LeastLoadedPolicy().choose(views, RouteRequest(key)).replica_id for key in KEYS} == {"r1"}
    # its requests in flight only: what was sent lately (recent) does not count
    busy_lately = pool({"r0": 2, "r1": 1}, recent={"r1": 50.0})
    assert LeastLoadedPolicy().choose(busy_lately, RouteRequest(KEYS[0])).replica_id == "r1"


def test_least_loaded_spreads_ties_by_key_and_keeps_each_keys_choice() -> None:
    views = pool({"r0": 1, "r1": 1, "r2": 1, "r3": 4})
    chosen = [LeastLoadedPolicy().choose(views, RouteRequest(key)).replica_id for key in KEYS]
    assert set(chosen) == {"r0", "r1", "r2"}  # every tied replica gets some keys, the busier one none
    assert chosen == [LeastLoadedPolicy().choose(list(reversed(views)), RouteRequest(key)).replica_id for key in KEYS]


def test_random_draws_from_its_rng_over_the_whole_pool() -> None:
    views = pool({"r0": 9, "r1": 0, "r2": 0})
    first = [RandomPolicy(random.Random(5)).choose(views, RouteRequest(b"k")).replica_id for _ in range(3)]
    policy = RandomPolicy(random.Random(5))
    drawn = Counter(policy.choose(views, RouteRequest(b"k")).replica_id for _ in range(300))
    assert set(drawn) == {"r0", "r1", "r2"} and min(drawn.values()) > 60  # load plays no part
    assert len(set(first)) == 1  # the same seed, the same first draw


def test_affinity_keeps_a_key_on_its_replica_until_the_bound_moves_it() -> None:
    views = pool({"r0": 0, "r1": 0, "r2": 0, "r3": 0})
    key = KEYS[3]
    favourite = AffinityPolicy(eps=0.25).choose(views, RouteRequest(key)).replica_id
    assert {AffinityPolicy(eps=0.25).choose(views, RouteRequest(key)).replica_id for _ in range(5)} == {favourite}
    loaded = pool({r.replica_id: (3 if r.replica_id == favourite else 0) for r in views})
    assert AffinityPolicy(eps=0.25).choose(loaded, RouteRequest(key)).replica_id != favourite
    assert AffinityPolicy(eps=10.0).choose(loaded, RouteRequest(key)).replica_id == favourite


def test_each_config_name_builds_its_policy_and_choose_runs_it() -> None:
    assert list(POLICIES) == ["affinity", "random", "least_loaded"]
    kinds = {name: type(RoutingSettings(policy=name).make_policy(random.Random(0))) for name in POLICIES}
    assert kinds == {"affinity": AffinityPolicy, "random": RandomPolicy, "least_loaded": LeastLoadedPolicy}
    views = pool({"r0": 2, "r1": 0})
    assert choose(views, KEYS[0], RoutingSettings(policy="least_loaded")).replica_id == "r1"
    with pytest.raises(NoCandidateError):
        choose([], KEYS[0])
    with pytest.raises(ValueError, match=r"unknown routing policy 'fastest' \(known: affinity, random, least_loaded\)"):
        RoutingSettings(policy="fastest")


def test_a_policy_added_to_the_one_list_is_a_config_name(monkeypatch: pytest.MonkeyPatch) -> None:
    class Last:
        def choose(self, pool, request):
            return pool[-1]

    monkeypatch.setitem(registry_module.POLICIES, "last", lambda settings, rng: Last())
    settings = RoutingSettings(policy="last")
    assert choose(pool({"r0": 0, "r1": 7}), KEYS[0], settings).replica_id == "r1"
