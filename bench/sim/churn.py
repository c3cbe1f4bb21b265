"""Adapters that move while a simulated fleet runs (the scenario's `sim.churn`), through the
registry's own placement functions: its re-plan (gateway.policy.placement.rebalance over the
requests routed since, halved after each, as Registry.replan) and new versions of adapters (on
the old version's shards, as Registry._place does, or place_new for one pinned nowhere). A shard
given an adapter serves it once its replicas have loaded it (adapter_load_s); one that loses it,
at once. A new version is served, and the old one unregistered, once its replicas have it."""

from __future__ import annotations

import bisect
import itertools
import random
from collections.abc import Callable, Sequence
from dataclasses import replace

from bench.sim.record import RunRecord
from bench.sim.replica import ReplicaModel
from bench.sim.workload import SimRequest, SimSection
from gateway.loadtest.scenario import Scenario
from gateway.policy.placement import PlacementError, zipf_shares
from gateway.policy.replan import place_new, rebalance

CallAt = Callable[..., None]  # call_at(at_s, call, *args): call(*args) at virtual time at_s, on the fleet's event heap


class Churn:
    def __init__(self, sim: SimSection, scenario: Scenario, shards: Sequence[str], replicas: list[ReplicaModel],
                 holders: dict[str, list[int]], pins_changed: Callable[[int], None], record: RunRecord, clock: Callable[[], float],
                 call_at: CallAt, adapter_load_s: float) -> None:
        """Churn in a fleet of `replicas` (`shards`: each one's shard): it changes their pins and
        `holders` (adapter -> the replicas pinning it) alike, tells the router with `pins_changed`
        (a replica's index), and counts its moves in `record`; `clock` and `call_at` are the
        fleet's virtual time."""
        self.replicas, self.holders, self.pins_changed, self.record = replicas, holders, pins_changed, record
        self.clock, self.call_at, self.adapter_load_s = clock, call_at, adapter_load_s
        self.duration_s = scenario.duration_s
        self.settings = settings = sim.churn
        self.redundancy = sim.redundancy
        self.capacity = settings.max_adapters_per_replica or sim.max_adapters_per_replica
        self.traffic: dict[str, float] = {}  # requests per adapter since the last re-plan (the registry's count)
        self.version_of: dict[str, str] = {}  # an adapter's name in the workload -> its current version's
        self.shard_of = shards
        self.members: dict[str, list[int]] = {}  # shard -> its replicas
        for i, shard in enumerate(self.shard_of):
            self.members.setdefault(shard, []).append(i)
        self.shard_replicas = {shard: len(m) for shard, m in self.members.items()}
        self.rng = random.Random(f"{scenario.seed}-churn")
        self._num_versions = 0
        self._names: list[str] = []
        self._weights: list[float] = []  # cumulative popularity of _names
        if settings.replan_interval_s is not None:
            call_at(settings.replan_interval_s, self.replan)
        if settings.new_versions_per_min > 0 and holders:
            mix = scenario.adapters
            shares = zipf_shares(mix.names, mix.zipf_s) if mix.zipf_s is not None else dict(mix.weights)
            self._names = [n for n in mix.names if n in holders]
            self._weights = list(itertools.accumulate(shares[n] for n in self._names))
            call_at(self.rng.expovariate(settings.new_versions_per_min / 60), self.new_version)

    # what the gateway sees of it

    def current(self, request: SimRequest) -> SimRequest:
        """The request for its adapter's current version (a tenant calls its adapter by name)."""
        name = self.version_of.get(request.adapter) if self.version_of else None
        return request if name is None else replace(request, adapter=name)

    def count(self, adapter: str) -> None:
        """A request routed for `adapter` (Registry.count: the re-plan's traffic)."""
        if self.settings.replan_interval_s is not None:
            self.traffic[adapter] = self.traffic.get(adapter, 0.0) + 1.0

    # the registry's moves

    def replan(self) -> None:
        now_s = self.clock()
        placed = {name: tuple(sorted({self.shard_of[i] for i in held})) for name, held in self.holders.items()}
        changes = rebalance(placed, self.traffic, self.shard_replicas, self.redundancy, self.capacity)
        self.traffic = {name: n / 2 for name, n in self.traffic.items() if n >= 1.0}
        self.record.num_replans += 1
        self.record.num_pins_moved += len(changes)
        for name, shards in changes.items():
            for shard in set(placed[name]) - set(shards):
                for i in self.members[shard]:
                    self._unpin(i, name)
            added = [i for shard in sorted(set(shards) - set(placed[name])) for i in self.members[shard]]
            if added:
                self.call_at(now_s + self.adapter_load_s, self.pinned, name, added, None)
        next_s = now_s + self.settings.replan_interval_s
        if next_s < self.duration_s:
            self.call_at(next_s, self.replan)

    def new_version(self) -> None:
        """A tenant registers a new version of an adapter, picked by popularity."""
        now_s = self.clock()
        base = self.rng.choices(self._names, cum_weights=self._weights)[0]
        old = self.version_of.get(base, base)
        self._num_versions += 1
        name = f"{base}~{self._num_versions}"
        shards = tuple(sorted({self.shard_of[i] for i in self.holders.get(old, ())}))  # where the old one was
        try:
            if not shards:
                pinned = {shard: len(self.replicas[m[0]].pinned) for shard, m in self.members.items()}
                shards = place_new(pinned, self.shard_replicas, self.redundancy, self.capacity)
        except PlacementError:
            self.record.num_unplaced += 1
        else:
            added = [i for shard in shards for i in self.members[shard]]
            self.call_at(now_s + self.adapter_load_s, self.pinned, name, added, (base, old))
        next_s = now_s + self.rng.expovariate(self.settings.new_versions_per_min / 60)
        if next_s < self.duration_s:
            self.call_at(next_s, self.new_version)

    def pinned(self, name: str, replicas: list[int], replacing: tuple[str, str] | None) -> None:
        """`replicas` have loaded `name`: they serve it (and, for a new version, the old one goes)."""
        for i in replicas:
            self._pin(i, name)
        if replacing is None:
            return
        base, old = replacing
        if self.version_of.get(base, base) != old:  # a later version was served first: this one is dropped
            for i in replicas:
                self._unpin(i, name)
            return
        self.version_of[base] = name
        self.record.num_new_versions += 1
        for i in list(self.holders.get(old, ())):
            self._unpin(i, old)
        self.traffic.pop(old, None)

    def _pin(self, i: int, name: str) -> None:
        replica = self.replicas[i]
        if name not in replica.pinned:
            replica.pinned = replica.pinned | {name}
            bisect.insort(self.holders.setdefault(name, []), i)
            self.pins_changed(i)

    def _unpin(self, i: int, name: str) -> None:
        replica = self.replicas[i]
        if name in replica.pinned:
            replica.pinned = replica.pinned - {name}
            replica.loaded.pop(name, None)
            held = self.holders[name]
            held.remove(i)
            if not held:
                del self.holders[name]
            self.pins_changed(i)
