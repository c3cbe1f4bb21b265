"""bench/sim's comparison routers: each a RoutingPolicy (the gateway's interface) over views."""

from __future__ import annotations

import random

from bench.sim.routers import FewestInFlightPolicy, RoundRobinPolicy, ScorerMixPolicy, TwoChoicesPolicy
from gateway.policy.routing import DEVICE, ReplicaView, RouteRequest

REQUEST = RouteRequest(b"", ("x",))


def views(in_flight: list[int], on_device: set[str] = frozenset()) -> list[ReplicaView]:
    return [ReplicaView(f"r{i}", "s", frozenset({"x"}), n, tiers={"x": DEVICE} if f"r{i}" in on_device else {})
            for i, n in enumerate(in_flight)]


def test_fewest_in_flight_takes_the_least_busy_and_the_first_of_equals() -> None:
    assert FewestInFlightPolicy().choose(views([3, 1, 0, 0]), REQUEST).replica_id == "r2"


def test_two_choices_takes_the_less_busy_of_the_two_drawn() -> None:
    pool = views([0, 9])
    assert {TwoChoicesPolicy(random.Random(seed)).choose(pool, REQUEST).replica_id for seed in range(20)} == {"r0"}
    assert TwoChoicesPolicy(random.Random(0)).choose(pool[1:], REQUEST).replica_id == "r1"


def test_round_robin_goes_in_turn_and_passes_over_replicas_not_in_the_pool() -> None:
    policy, pool = RoundRobinPolicy(["r0", "r1", "r2"]), views([0, 0, 0])
    assert [policy.choose(pool, REQUEST).replica_id for _ in range(4)] == ["r0", "r1", "r2", "r0"]
    assert policy.choose([pool[0], pool[2]], REQUEST).replica_id == "r2"  # r1's turn, but it was tried
    assert policy.choose(pool, REQUEST).replica_id == "r0"


def test_scorer_mix_weighs_the_adapter_on_device_the_prefix_sent_before_and_the_queue() -> None:
    weights = {"adapter": 2.0, "prefix": 3.0, "queue": 2.0}
    policy = ScorerMixPolicy(random.Random(0), weights)
    assert policy.choose(views([2, 0, 2]), REQUEST).replica_id == "r1"  # the queue alone: the idle one
    # the adapter on its device (2) and half the queue's span (1) beat the idle replica without it (2)
    assert policy.choose(views([0, 2, 1], on_device={"r2"}), REQUEST).replica_id == "r2"
    keyed = RouteRequest(b"tenant\0x\0prefix-1", ("x",))
    first = policy.choose(views([0, 0, 0]), keyed).replica_id  # all equal: one at random, remembered for the key
    assert {policy.choose(views([0, 0, 0]), keyed).replica_id for _ in range(5)} == {first}
