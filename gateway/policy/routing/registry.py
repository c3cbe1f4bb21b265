"""The policies a config may name (POLICIES: the one list), the config's `routing` section that
names one (RoutingSettings), and `choose`: the named policy's pick.

Adding a policy: its class (the RoutingPolicy interface: gateway/policy/routing/policy.py), and
one line in POLICIES saying how the settings build it.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

from gateway.policy.routing.affinity import AffinityPolicy
from gateway.policy.routing.baselines import LeastLoadedPolicy, RandomPolicy
from gateway.policy.routing.candidates import NoCandidateError
from gateway.policy.routing.policy import RouteRequest, RoutingPolicy
from gateway.policy.routing.view import ReplicaView
from worker.contract.calls import CHANNEL_HEARTBEAT_S
from worker.contract.identity import Fingerprint

# each policy's config name -> the policy, built from the settings and the caller's RNG (None: the
# `random` module's own); errors list the names in this order
POLICIES: dict[str, Callable[[RoutingSettings, random.Random | None], RoutingPolicy]] = {
    "affinity": lambda settings, rng: AffinityPolicy(settings.eps),
    "random": lambda settings, rng: RandomPolicy(rng),
    "least_loaded": lambda settings, rng: LeastLoadedPolicy(),
}


@dataclass(frozen=True)
class RoutingSettings:
    """How the gateway routes and fails over (the deployment config's `routing`; every default here, once)."""

    policy: str = "affinity"  # one of POLICIES
    eps: float = 0.25  # bounded load: a replica takes a request while its load stays within (1 + eps) x the mean
    half_life_s: float = 30.0  # of the recent-load count (RecentLoad)
    max_attempts: int = 2  # replicas a request may be tried on: one failover, so one poison request cannot take down them all
    failed_cooldown_s: float = 5.0  # a replica that failed gets no request for this long
    worker_grace_s: float = 5.0  # past the worker's own deadline, the gateway stops waiting for it
    health_timeout_s: float = 2.0  # a replica's answer to health and metrics
    busy_retry_after_s: int = 1  # Retry-After of a 503 when every replica is busy
    # a replica's channel silent this long (it sends a heartbeat each CHANNEL_HEARTBEAT_S) fails: its
    # requests go elsewhere, and it gets none until it is heard from again (gateway/cluster/channel.py)
    unresponsive_after_s: float = 10.0

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"unknown routing policy {self.policy!r} (known: {', '.join(POLICIES)})")
        if not self.eps > 0 or not self.half_life_s > 0:
            raise ValueError(f"eps and half_life_s must be > 0, got {self.eps} and {self.half_life_s}")
        if self.max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {self.max_attempts}")
        if min(self.failed_cooldown_s, self.worker_grace_s, self.busy_retry_after_s) < 0 or not self.health_timeout_s > 0:
            raise ValueError("failed_cooldown_s, worker_grace_s and busy_retry_after_s must be >= 0, health_timeout_s > 0")
        if not self.unresponsive_after_s >= 2 * CHANNEL_HEARTBEAT_S:
            raise ValueError(f"unresponsive_after_s must be at least twice the replicas' heartbeat ({CHANNEL_HEARTBEAT_S:g} s), "
                             f"got {self.unresponsive_after_s}")

    def make_policy(self, rng: random.Random | None = None) -> RoutingPolicy:
        """The policy these settings name, drawing from `rng` if it draws at random."""
        return POLICIES[self.policy](self, rng)


def choose(pool: Sequence[ReplicaView], key: bytes, settings: RoutingSettings = RoutingSettings(), *,
           rng: random.Random | None = None, shared_cache: bool = True,
           fingerprints: Collection[Fingerprint] = ()) -> ReplicaView:
    """One replica of `pool` (the candidates) for a request with affinity `key` and adapters
    `fingerprints`, by the policy `settings` names (and, for affinity, its bound `settings.eps`).
    `shared_cache`: every replica can fetch every prefix (Redis); without it, affinity does
    not spill a request to an idle replica, where its prefix would be computed again."""
    if not pool:
        raise NoCandidateError("no candidate replicas")
    return settings.make_policy(rng).choose(pool, RouteRequest(key, fingerprints, shared_cache))
