"""The policies an operator may choose to compare affinity against: `random`, and `least_loaded`
(fewest requests in flight)."""

from __future__ import annotations

import random
from collections.abc import Sequence

from gateway.policy.routing.policy import RouteRequest
from gateway.policy.routing.rendezvous import _rank, key_bits
from gateway.policy.routing.view import ReplicaView


class RandomPolicy:
    """Any candidate, uniformly, drawn from `rng` (the `random` module's own when None)."""

    def __init__(self, rng: random.Random | None = None) -> None:
        self.rng = rng

    def choose(self, pool: Sequence[ReplicaView], request: RouteRequest) -> ReplicaView:
        return (self.rng or random).choice(list(pool))


class LeastLoadedPolicy:
    """The candidate with the fewest requests in flight; among equals, the one with the lowest
    rendezvous rank for the request's key, so ties spread by key instead of all going to one replica."""

    def choose(self, pool: Sequence[ReplicaView], request: RouteRequest) -> ReplicaView:
        bits = key_bits(request.key)
        return min(pool, key=lambda r: (r.in_flight, _rank(bits, r.replica_id)))
