"""The routers a simulated gateway may use, each named for what it does. `ours` is the
production code, unchanged: gateway.policy.routing's candidates and choose over ReplicaViews
built as gateway/dispatch.py builds them, with RecentLoad on the simulation's clock. The
others are there to compare against.

A router sees the fleet as the gateway does: what each replica pins (`pinned`), the requests
it has in flight there, and the replicas this request was already tried on. It returns a
replica's index or raises one of routing's errors (NoCandidateError: no replica holds the
adapter; ReplicasBusy: all that do are full).
"""

from __future__ import annotations

import random
import zlib
from collections.abc import Callable, Collection, Sequence

from bench.sim.replica import ReplicaModel
from bench.sim.workload import BASE, SimRequest
from gateway.policy.routing import (
    NoCandidateError,
    RecentLoad,
    ReplicasBusy,
    Residents,
    ReplicaView,
    RoutingSettings,
    affinity_key,
    candidates,
    choose,
)
from worker.contract.identity import Fingerprint

ROUTERS = ("ours", "holders-then-p2c", "scorer-mix", "holders-only-least-loaded", "least-loaded", "round-robin")
REPORT_S = 10.0  # how often a worker with tiers reports where its adapters are (the registry's resync_interval_s)
SCORER_WEIGHTS = {"adapter": 2.0, "prefix": 3.0, "queue": 2.0}  # llm-d-like: LoRA affinity, prefix cache, queue depth


def request_key(request: SimRequest, chunk_tokens: int) -> bytes:
    """The production affinity key: adapter set + first prompt chunk. The first chunk's tokens
    stand in as (tenant, prefix) for a shared prefix, the request itself otherwise."""
    first = (zlib.crc32(request.tenant.encode()), request.prefix) if request.prefix >= 0 and request.num_prefix_tokens >= chunk_tokens \
        else (1 << 20, request.index)
    return affinity_key(request.adapter if request.adapter != BASE else "", first, chunk_tokens)


class Router:
    name = ""

    def __init__(self, replicas: Sequence[ReplicaModel], holders: dict[str, list[int]], settings: RoutingSettings,
                 rng: random.Random, shared_cache: bool, clock: Callable[[], float]) -> None:
        self.replicas, self.holders, self.settings, self.rng = replicas, holders, settings, rng
        self.shared_cache, self.clock = shared_cache, clock
        self.all = list(range(len(replicas)))

    def holding(self, request: SimRequest) -> list[int]:
        return self.all if request.adapter == BASE else self.holders.get(request.adapter, [])

    def route(self, request: SimRequest, key: bytes, tried: Collection[int]) -> int:
        raise NotImplementedError

    def pins_changed(self, i: int) -> None:
        """Replica `i` pins other adapters now (`holders` says who pins what already)."""


class Ours(Router):
    """gateway/dispatch.py's _route: candidates, then choose, then count it in RecentLoad; with
    tiers, each replica's `Residents` (the gateway's model of where a worker has its adapters) from
    a report every REPORT_S (the registry's resync) and the requests routed since."""

    name = "ours"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.recent = RecentLoad(self.settings.half_life_s)
        self.ids = [f"r{i}" for i in self.all]
        self.index = {replica_id: i for i, replica_id in enumerate(self.ids)}
        self.fingerprints = [frozenset(Fingerprint(a) for a in r.pinned) for r in self.replicas]
        self.residents: list[Residents | None] = [None] * len(self.replicas)
        self.reported_s = [float("-inf")] * len(self.replicas)
        self.is_tiered = any(r.is_tiered for r in self.replicas)

    def pins_changed(self, i: int) -> None:
        self.fingerprints[i] = frozenset(Fingerprint(a) for a in self.replicas[i].pinned)

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
        needed = () if request.adapter == BASE else (Fingerprint(request.adapter),)
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


class HoldersThenP2C(Router):
    """Replicas pinning the adapter; of two drawn at random, the one with fewer in flight."""

    name = "holders-then-p2c"

    def route(self, request: SimRequest, key: bytes, tried: Collection[int]) -> int:
        pool = _untried(self.holding(request), tried, f"holds {request.adapter}")
        if len(pool) == 1:
            return pool[0]
        a, b = self.rng.sample(pool, 2)
        return a if self.replicas[a].in_flight <= self.replicas[b].in_flight else b


class ScorerMix(Router):
    """Every replica scored, llm-d style: holds the adapter (pinned or loaded), was sent this
    prefix before (the router's own record), and its queue (min-max normalized); the best
    score, ties at random."""

    name = "scorer-mix"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.prefix_seen: dict[tuple[str, str, int], set[int]] = {}

    def route(self, request: SimRequest, key: bytes, tried: Collection[int]) -> int:
        pool = _untried(self.all, tried, "at all")
        loads = [self.replicas[i].in_flight for i in pool]
        low, high = min(loads), max(loads)
        span = (high - low) or 1
        seen = self.prefix_seen.get((request.tenant, request.adapter, request.prefix), set()) if request.prefix >= 0 else set()
        w = SCORER_WEIGHTS
        best, best_score = [], float("-inf")
        for i, load in zip(pool, loads):
            score = (w["adapter"] * self.replicas[i].holds(request.adapter) + w["prefix"] * (i in seen)
                     + w["queue"] * (high - load) / span)
            if score > best_score:
                best, best_score = [i], score
            elif score == best_score:
                best.append(i)
        chosen = best[0] if len(best) == 1 else self.rng.choice(best)
        if request.prefix >= 0:
            self.prefix_seen.setdefault((request.tenant, request.adapter, request.prefix), set()).add(chosen)
        return chosen


class HoldersLeastLoaded(Router):
    """Of the replicas pinning the adapter, the one with the fewest in flight (ties: lowest index)."""

    name = "holders-only-least-loaded"

    def route(self, request: SimRequest, key: bytes, tried: Collection[int]) -> int:
        return min(_untried(self.holding(request), tried, f"holds {request.adapter}"), key=lambda i: self.replicas[i].in_flight)


class LeastLoaded(Router):
    """Of every replica, the one with the fewest in flight, wherever the adapter is (a replica
    without it loads it first)."""

    name = "least-loaded"

    def route(self, request: SimRequest, key: bytes, tried: Collection[int]) -> int:
        return min(_untried(self.all, tried, "at all"), key=lambda i: self.replicas[i].in_flight)


class RoundRobin(Router):
    """Every replica in turn, wherever the adapter is."""

    name = "round-robin"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.next = 0

    def route(self, request: SimRequest, key: bytes, tried: Collection[int]) -> int:
        for _ in self.all:
            i, self.next = self.next, (self.next + 1) % len(self.all)
            if i not in tried:
                return i
        raise NoCandidateError("no untried replica at all")


def make_router(name: str, *args, **kwargs) -> Router:
    kinds = {cls.name: cls for cls in (Ours, HoldersThenP2C, ScorerMix, HoldersLeastLoaded, LeastLoaded, RoundRobin)}
    if name not in kinds:
        raise ValueError(f"unknown router {name!r} (known: {', '.join(ROUTERS)})")
    return kinds[name](*args, **kwargs)


__all__ = ["ROUTERS", "NoCandidateError", "ReplicasBusy", "Router", "make_router", "request_key"]
