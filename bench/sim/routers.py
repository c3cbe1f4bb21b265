"""The routers a simulated gateway may use, each named for what it does. `ours` is the
production code, unchanged: gateway.policy.routing's candidates and choose over ReplicaViews
built as gateway/requests/dispatch.py builds them, with RecentLoad on the simulation's clock. The
others are there to compare against: each is a RoutingPolicy (the gateway's interface:
gateway/policy/routing/policy.py) over views of the replicas it may pick from, kept here because
no gateway would route that way (they pick among replicas that do not serve the adapter, ignore
health and room, or break ties by position).

A router sees the fleet as the gateway does: what each replica pins (`pinned`), the requests
it has in flight there, and the replicas this request was already tried on. It returns a
replica's index or raises one of routing's errors (NoCandidateError: no replica holds the
adapter; ReplicasBusy: all that do are full).
"""

from __future__ import annotations

import random
import zlib
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from typing import Any

from bench.sim.replica import ReplicaModel
from bench.sim.workload import BASE, SimRequest
from gateway.policy.routing import (
    DEVICE,
    NoCandidateError,
    RecentLoad,
    ReplicasBusy,
    ReplicaView,
    Residents,
    RouteRequest,
    RoutingPolicy,
    RoutingSettings,
    affinity_key,
    candidates,
    choose,
)
from worker.contract.identity import Fingerprint

REPORT_S = 10.0  # how often a worker with tiers reports where its adapters are (the registry's resync_interval_s)
SCORER_WEIGHTS = {"adapter": 2.0, "prefix": 3.0, "queue": 2.0}  # llm-d-like: LoRA affinity, prefix cache, queue depth


def request_key(request: SimRequest, chunk_tokens: int) -> bytes:
    """The production affinity key: adapter set + first prompt chunk. The first chunk's tokens
    stand in as (tenant, prefix) for a shared prefix, the request itself otherwise."""
    first = (zlib.crc32(request.tenant.encode()), request.prefix) if request.prefix >= 0 and request.num_prefix_tokens >= chunk_tokens \
        else (1 << 20, request.index)
    return affinity_key(request.adapter if request.adapter != BASE else "", first, chunk_tokens)


def _needed(request: SimRequest) -> tuple[Fingerprint, ...]:
    return () if request.adapter == BASE else (Fingerprint(request.adapter),)


# the comparison routers' policies


class TwoChoicesPolicy:
    """Of two replicas of the pool drawn at random, the one with fewer requests in flight (the
    first drawn when they have as many)."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng

    def choose(self, pool: Sequence[ReplicaView], request: RouteRequest) -> ReplicaView:
        if len(pool) == 1:
            return pool[0]
        a, b = self.rng.sample(pool, 2)
        return a if a.in_flight <= b.in_flight else b


class ScorerMixPolicy:
    """Every replica of the pool scored, llm-d style: has the request's adapters on its device, was
    sent the request's key before (the policy's own record; an empty key is never recorded), and its
    requests in flight (min-max normalized); the best score, ties at random."""

    def __init__(self, rng: random.Random, weights: Mapping[str, float]) -> None:
        self.rng, self.weights = rng, weights
        self.sent: dict[bytes, set[str]] = {}  # key -> the replicas it was sent to

    def choose(self, pool: Sequence[ReplicaView], request: RouteRequest) -> ReplicaView:
        loads = [r.in_flight for r in pool]
        low, high = min(loads), max(loads)
        span = (high - low) or 1
        seen = self.sent.get(request.key, set()) if request.key else set()
        w = self.weights
        best: list[ReplicaView] = []
        best_score = float("-inf")
        for r, load in zip(pool, loads):
            score = (w["adapter"] * (r.tier(request.fingerprints) == DEVICE) + w["prefix"] * (r.replica_id in seen)
                     + w["queue"] * (high - load) / span)
            if score > best_score:
                best, best_score = [r], score
            elif score == best_score:
                best.append(r)
        chosen = best[0] if len(best) == 1 else self.rng.choice(best)
        if request.key:
            self.sent.setdefault(request.key, set()).add(chosen.replica_id)
        return chosen


class FewestInFlightPolicy:
    """The replica of the pool with the fewest requests in flight; among equals, the first."""

    def choose(self, pool: Sequence[ReplicaView], request: RouteRequest) -> ReplicaView:
        return min(pool, key=lambda r: r.in_flight)


class RoundRobinPolicy:
    """Every replica in turn (`order`: their ids), passing over those not in the pool."""

    def __init__(self, order: Sequence[str]) -> None:
        self.order, self.next = list(order), 0

    def choose(self, pool: Sequence[ReplicaView], request: RouteRequest) -> ReplicaView:
        by_id = {r.replica_id: r for r in pool}
        for _ in self.order:
            replica_id, self.next = self.order[self.next], (self.next + 1) % len(self.order)
            if replica_id in by_id:
                return by_id[replica_id]
        raise NoCandidateError("no replica of the pool is in the round")


class OnDevice(Mapping[Fingerprint, int]):
    """Where a simulated replica has its adapters now, as a scorer reading the workers' metrics sees
    it: DEVICE for those it runs without loading them first (ReplicaView.tier: LOWER for the rest)."""

    def __init__(self, replica: ReplicaModel) -> None:
        self.replica = replica

    def get(self, fingerprint: Fingerprint, default: Any = None) -> Any:
        return DEVICE if self.replica.holds(fingerprint) else default

    def __getitem__(self, fingerprint: Fingerprint) -> int:
        if self.replica.holds(fingerprint):
            return DEVICE
        raise KeyError(fingerprint)

    def __iter__(self) -> Iterator[Fingerprint]:
        replica = self.replica
        return iter(replica.loaded.keys() | (set() if replica.is_tiered else replica.pinned))

    def __len__(self) -> int:
        return sum(1 for _ in self)


# the routers


class Router:
    name = ""

    def __init__(self, replicas: Sequence[ReplicaModel], holders: dict[str, list[int]], settings: RoutingSettings,
                 rng: random.Random, shared_cache: bool, clock: Callable[[], float]) -> None:
        self.replicas, self.holders, self.settings, self.rng = replicas, holders, settings, rng
        self.shared_cache, self.clock = shared_cache, clock
        self.all = list(range(len(replicas)))
        self.ids = [f"r{i}" for i in self.all]
        self.index = {replica_id: i for i, replica_id in enumerate(self.ids)}
        self.fingerprints = [frozenset(Fingerprint(a) for a in r.pinned) for r in self.replicas]

    def holding(self, request: SimRequest) -> list[int]:
        return self.all if request.adapter == BASE else self.holders.get(request.adapter, [])

    def route(self, request: SimRequest, key: bytes, tried: Collection[int]) -> int:
        raise NotImplementedError

    def pins_changed(self, i: int) -> None:
        """Replica `i` pins other adapters now (`holders` says who pins what already)."""
        self.fingerprints[i] = frozenset(Fingerprint(a) for a in self.replicas[i].pinned)


class Ours(Router):
    """gateway/requests/dispatch.py's _route: candidates, then choose, then count it in RecentLoad; with
    tiers, each replica's `Residents` (the gateway's model of where a worker has its adapters) from
    a report every REPORT_S (the registry's resync) and the requests routed since."""

    name = "ours"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.recent = RecentLoad(self.settings.half_life_s)
        self.residents: list[Residents | None] = [None] * len(self.replicas)
        self.reported_s = [float("-inf")] * len(self.replicas)
        self.is_tiered = any(r.is_tiered for r in self.replicas)

    def tiers(self, i: int, now_s: float) -> Residents | None:
        replica = self.replicas[i]
        if not replica.is_tiered:
            return None
        if now_s - self.reported_s[i] >= REPORT_S:
            host = list(replica.host) if replica.host_capacity is not None else list(replica.pinned)
            self.residents[i] = Residents({"device": list(replica.loaded), "host": host, "capacity": replica.capacity})
            self.reported_s[i] = now_s
        return self.residents[i]

    def route(self, request: SimRequest, key: bytes, tried: Collection[int]) -> int:
        now_s = self.clock()
        config = self.replicas[0].config
        slots, capacity, ids, fingerprints, replicas = config.num_seq_slots, config.num_seq_slots + config.max_waiting, \
            self.ids, self.fingerprints, self.replicas
        held = self.holding(request)
        recent = self.recent.get_many([ids[i] for i in held], now_s)
        tiers = [self.tiers(i, now_s) for i in held] if self.is_tiered else [None] * len(held)
        # views of the replicas that pin the adapter: candidates() keeps only those anyway
        views = [ReplicaView(ids[i], ids[i], fingerprints[i], in_flight=replicas[i].in_flight, recent=load,
                             num_seq_slots=slots, capacity=capacity, tiers=residents)
                 for i, load, residents in zip(held, recent, tiers)]
        needed = _needed(request)
        pool = candidates(views, needed, exclude={self.ids[i] for i in tried})
        chosen = choose(pool, key, self.settings, rng=self.rng, shared_cache=self.shared_cache, fingerprints=needed)
        self.recent.add(chosen.replica_id, now_s)
        index = self.index[chosen.replica_id]
        if self.residents[index] is not None:
            self.residents[index].promoted(needed)
        return index


def _untried(indices: Sequence[int], tried: Collection[int], what: str) -> list[int]:
    left = [i for i in indices if i not in tried] if tried else list(indices)
    if not left:
        raise NoCandidateError(f"no untried replica {what}")
    return left


class Compared(Router):
    """A comparison router: views of the replicas it may pick from and was not tried on (those
    pinning the adapter when `is_holders_only`, else every one), and its policy's pick of them.
    Each replica's view is built once and its requests in flight brought up to date before each
    pick: building hundreds of views per request would cost more than the routing does."""

    is_holders_only = True

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.views = [ReplicaView(replica_id, replica_id, fingerprints, tiers=OnDevice(replica))
                      for replica_id, fingerprints, replica in zip(self.ids, self.fingerprints, self.replicas)]
        self.policy = self.make_policy()

    def pins_changed(self, i: int) -> None:
        super().pins_changed(i)
        self.views[i].fingerprints = self.fingerprints[i]

    def make_policy(self) -> RoutingPolicy:
        raise NotImplementedError

    def route_request(self, request: SimRequest, key: bytes) -> RouteRequest:
        return RouteRequest(key, _needed(request), self.shared_cache)

    def route(self, request: SimRequest, key: bytes, tried: Collection[int]) -> int:
        if self.is_holders_only:
            indices = _untried(self.holding(request), tried, f"holds {request.adapter}")
        else:
            indices = _untried(self.all, tried, "at all")
        replicas, views = self.replicas, self.views
        for i in indices:
            views[i].in_flight = replicas[i].in_flight
        pool = [views[i] for i in indices]
        return self.index[self.policy.choose(pool, self.route_request(request, key)).replica_id]


class HoldersThenP2C(Compared):
    """Replicas pinning the adapter; of two drawn at random, the one with fewer in flight."""

    name = "holders-then-p2c"

    def make_policy(self) -> RoutingPolicy:
        return TwoChoicesPolicy(self.rng)


class ScorerMix(Compared):
    """Every replica scored, llm-d style: holds the adapter (pinned or loaded), was sent this
    prefix before (the router's own record: the key is the request's shared prefix, none without
    one), and its queue (min-max normalized); the best score, ties at random."""

    name = "scorer-mix"
    is_holders_only = False

    def make_policy(self) -> RoutingPolicy:
        return ScorerMixPolicy(self.rng, SCORER_WEIGHTS)

    def route_request(self, request: SimRequest, key: bytes) -> RouteRequest:
        prefix = f"{request.tenant}\0{request.adapter}\0{request.prefix}".encode() if request.prefix >= 0 else b""
        return RouteRequest(prefix, _needed(request), self.shared_cache)


class HoldersLeastLoaded(Compared):
    """Of the replicas pinning the adapter, the one with the fewest in flight (ties: lowest index)."""

    name = "holders-only-least-loaded"

    def make_policy(self) -> RoutingPolicy:
        return FewestInFlightPolicy()


class LeastLoaded(Compared):
    """Of every replica, the one with the fewest in flight, wherever the adapter is (a replica
    without it loads it first)."""

    name = "least-loaded"
    is_holders_only = False

    def make_policy(self) -> RoutingPolicy:
        return FewestInFlightPolicy()


class RoundRobin(Compared):
    """Every replica in turn, wherever the adapter is."""

    name = "round-robin"
    is_holders_only = False

    def make_policy(self) -> RoutingPolicy:
        return RoundRobinPolicy(self.ids)


_KINDS: tuple[type[Router], ...] = (Ours, HoldersThenP2C, ScorerMix, HoldersLeastLoaded, LeastLoaded, RoundRobin)
ROUTERS = tuple(kind.name for kind in _KINDS)


def make_router(name: str, *args, **kwargs) -> Router:
    kinds = {cls.name: cls for cls in _KINDS}
    if name not in kinds:
        raise ValueError(f"unknown router {name!r} (known: {', '.join(ROUTERS)})")
    return kinds[name](*args, **kwargs)


__all__ = ["ROUTERS", "NoCandidateError", "ReplicasBusy", "Router", "make_router", "request_key"]
