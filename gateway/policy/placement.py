"""Which adapters each worker pins (docs/architecture.md#routing-and-placement): a pure function from adapters, expected
traffic shares, worker count and per-worker capacity to shards and replicas (torch-free).

1. Copies: every adapter gets `redundancy` copies (2 when there are two workers or
   more, so one replica's failure never removes an adapter); the remaining slots go,
   one at a time, to the adapter whose traffic per copy is highest (hot adapters
   spread over many workers), never more copies than workers.
2. Placement: copies in decreasing traffic per copy, each onto the least-loaded
   worker that does not hold that adapter yet and has room (longest processing time
   first, with the distinctness constraint). Then, while two workers hold the same
   set, one swaps its coldest adapter for a similarly cold one of a third worker:
   the copies of every adapter end up on distinct shards, at a negligible cost in
   balance.
3. Workers with the same adapter set form one shard with that many replicas.

A request for an adapter is spread evenly over the replicas that hold it, so a
worker's expected load is the sum over its adapters of share / copies.
Deterministic: ties break by adapter name and worker index.
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from worker.contract.identity import Fingerprint


class PlacementError(ValueError):
    """The inputs cannot fit; the message says by how much."""


@dataclass(frozen=True)
class AdapterSpec:
    name: str
    size_bytes: int = 0
    path: str = ""


@dataclass(frozen=True)
class Shard:
    name: str
    adapters: tuple[str, ...]
    replicas: int
    load_per_replica: float  # expected share of all traffic, per replica


@dataclass(frozen=True)
class Plan:
    shards: tuple[Shard, ...]
    copies: dict[str, int]
    worker_loads: tuple[float, ...]
    warnings: tuple[str, ...] = ()

    @property
    def max_over_mean(self) -> float:
        mean = sum(self.worker_loads) / len(self.worker_loads)
        return max(self.worker_loads) / mean if mean > 0 else 1.0


def normalize(shares: Mapping[str, float], names: Sequence[str]) -> dict[str, float]:
    """Shares for every adapter (missing: 0), summing to 1 (all equal when none are given)."""
    unknown = sorted(set(shares) - set(names))
    if unknown:
        raise PlacementError(f"traffic names adapters that are not in the adapter list: {', '.join(unknown)}")
    bad = [n for n, s in shares.items() if not s >= 0]
    if bad:
        raise PlacementError(f"traffic share of {bad[0]!r} must be a number >= 0, got {shares[bad[0]]!r}")
    total = sum(shares.values())
    if total <= 0:
        return {n: 1.0 / len(names) for n in names}
    return {n: shares.get(n, 0.0) / total for n in names}


def plan(adapters: Sequence[AdapterSpec], shares: Mapping[str, float], num_workers: int,
         max_adapters: int | None = None, max_bytes: int | None = None, redundancy: int = 2) -> Plan:
    """Place every adapter on workers of at most `max_adapters` adapters and `max_bytes` bytes."""
    _check_fits(adapters, num_workers, max_adapters, max_bytes)
    names = [a.name for a in adapters]
    size = {a.name: a.size_bytes for a in adapters}
    share = normalize(shares, names)
    order = sorted(names, key=lambda n: (-share[n], n))  # hottest first; ties by name
    target = min(redundancy, num_workers)
    copies = _count_copies(names, order, share, size, num_workers, max_adapters, max_bytes, target)  # 1.
    workers = _Workers(num_workers, size, share, copies, max_adapters, max_bytes)
    workers.place_copies(names)  # 2.
    held = workers.held
    load = [sum(share[n] / copies[n] for n in held[w]) for w in range(num_workers)]  # with the final copy counts
    warnings = _single_copy_warnings(names, share, copies, target)
    per_copy = {n: share[n] / copies[n] for n in names}
    _separate_identical_sets(held, workers.held_bytes, load, per_copy, size, max_bytes)
    return Plan(_shards(held, order, load), copies, tuple(load), tuple(warnings))  # 3.


def _check_fits(adapters: Sequence[AdapterSpec], num_workers: int, max_adapters: int | None, max_bytes: int | None) -> None:
    """PlacementError unless the adapters are named once each and fit on the workers at all."""
    names = [a.name for a in adapters]
    if len(set(names)) != len(names):
        raise PlacementError("adapter names must be unique")
    if num_workers < 1:
        raise PlacementError(f"need at least one worker, got {num_workers}")
    if not adapters:
        raise PlacementError("no adapters to place")
    if max_adapters is None and max_bytes is None:
        raise PlacementError("give a capacity: adapters per worker or bytes per worker")
    if max_adapters is not None and max_adapters < 1:
        raise PlacementError(f"capacity must be at least 1 adapter per worker, got {max_adapters}")
    too_big = [a for a in adapters if max_bytes is not None and a.size_bytes > max_bytes]
    if too_big:
        raise PlacementError(f"adapter {too_big[0].name!r} ({too_big[0].size_bytes} bytes) is larger than a worker's capacity "
                             f"({max_bytes} bytes)")
    if max_adapters is not None and len(adapters) > num_workers * max_adapters:
        raise PlacementError(f"{len(adapters)} adapters do not fit on {num_workers} workers of {max_adapters}: "
                             f"{num_workers * max_adapters} slots (need {-(-len(adapters) // max_adapters)} workers)")
    total_bytes = sum(a.size_bytes for a in adapters)
    if max_bytes is not None and total_bytes > num_workers * max_bytes:
        raise PlacementError(f"the adapters ({total_bytes} bytes) do not fit on {num_workers} workers of {max_bytes} bytes")


def _count_copies(names: Sequence[str], order: Sequence[str], share: Mapping[str, float], size: Mapping[str, int],
                  num_workers: int, max_adapters: int | None, max_bytes: int | None, target: int) -> dict[str, int]:
    """Copies per adapter (`order`: `names` hottest first): `target` each, hottest first, as far as
    room allows; then the spare room, one copy at a time, to the adapter with the most traffic per
    copy. Never more than the workers."""
    budget_slots = num_workers * max_adapters if max_adapters is not None else None
    budget_bytes = num_workers * max_bytes if max_bytes is not None else None
    copies = dict.fromkeys(names, 1)
    used_slots, used_bytes = len(names), sum(size.values())

    def fits(name: str) -> bool:
        return (copies[name] < num_workers and (budget_slots is None or used_slots + 1 <= budget_slots)
                and (budget_bytes is None or used_bytes + size[name] <= budget_bytes))

    for name in order:  # redundancy, hottest first, as far as room allows
        while copies[name] < target and fits(name):
            copies[name] += 1
            used_slots, used_bytes = used_slots + 1, used_bytes + size[name]
    heap = [(-share[n] / copies[n], n) for n in names]
    heapq.heapify(heap)
    while heap:  # spare room: another copy for the adapter with the most traffic per copy
        per_copy, name = heapq.heappop(heap)
        if -per_copy <= 0 or not fits(name):
            continue
        copies[name] += 1
        used_slots, used_bytes = used_slots + 1, used_bytes + size[name]
        heapq.heappush(heap, (-share[name] / copies[name], name))
    return copies


class _Workers:
    """The workers while copies are placed on them: what each holds, its bytes and its expected
    load. `copies` is the plan's count, which loses a spare copy that fits nowhere."""

    def __init__(self, num_workers: int, size: Mapping[str, int], share: Mapping[str, float], copies: dict[str, int],
                 max_adapters: int | None, max_bytes: int | None) -> None:
        self.num_workers, self.size, self.share, self.copies = num_workers, size, share, copies
        self.max_adapters, self.max_bytes = max_adapters, max_bytes
        self.load = [0.0] * num_workers
        self.held: list[list[str]] = [[] for _ in range(num_workers)]
        self.held_sets: list[set[str]] = [set() for _ in range(num_workers)]  # the same, for membership (fleets hold thousands)
        self.held_bytes = [0] * num_workers
        # the workers by (load, adapters, index), one current entry each: the least loaded with room is the first popped
        # that has room (a fleet's plan places ~10^5 copies on hundreds of workers); one full by count is dropped
        self.by_load = [(0.0, 0, w) for w in range(num_workers)]

    def place_copies(self, names: Sequence[str]) -> None:
        """Every copy, longest first (traffic per copy; ties by name), on the least-loaded worker
        that can take it, or one that can once it moves an adapter to another with room."""
        share, copies, by_load = self.share, self.copies, self.by_load
        pieces = sorted(((share[n] / copies[n], n) for n in names for _ in range(copies[n])), key=lambda p: (-p[0], p[1]))
        for per_copy, name in pieces:
            w = self.least_loaded_with_room(name)
            if w is None:
                w = self.make_room(name)
                by_load[:] = [(self.load[v], len(self.held[v]), v) for v in range(self.num_workers) if v != w]  # it moved adapters
                heapq.heapify(by_load)
            if w is None:
                if any(name in h for h in self.held_sets):
                    copies[name] -= 1  # a spare copy that fits nowhere: drop it
                    continue
                raise PlacementError(f"could not place {name!r}: every worker is full or already holds it "
                                     "(try more workers or capacity)")
            self.put(w, name, per_copy)
            heapq.heappush(by_load, (self.load[w], len(self.held[w]), w))

    def room(self, w: int, name: str, freed: str | None = None) -> bool:
        """Worker `w` can take `name` (once `freed` leaves it)."""
        used_bytes = self.held_bytes[w] - (self.size[freed] if freed else 0)
        return (name not in self.held_sets[w]
                and (self.max_adapters is None or len(self.held[w]) - (freed is not None) < self.max_adapters)
                and (self.max_bytes is None or used_bytes + self.size[name] <= self.max_bytes))

    def put(self, w: int, name: str, per_copy: float) -> None:
        self.held[w].append(name)
        self.held_sets[w].add(name)
        self.held_bytes[w] += self.size[name]
        self.load[w] += per_copy

    def least_loaded_with_room(self, name: str) -> int | None:
        by_load, aside, found = self.by_load, [], None
        while by_load:
            entry = heapq.heappop(by_load)
            if self.room(entry[2], name):
                found = entry[2]
                break
            if self.max_adapters is None or len(self.held[entry[2]]) < self.max_adapters:
                aside.append(entry)
        for entry in aside:
            heapq.heappush(by_load, entry)
        return found

    def make_room(self, name: str) -> int | None:
        """A worker lacking `name` that can take it once one of its adapters moves to a worker with room."""
        share, copies, held, held_sets = self.share, self.copies, self.held, self.held_sets
        for w in sorted((w for w in range(self.num_workers) if name not in held_sets[w]), key=lambda i: (self.load[i], i)):
            for other in sorted(held[w], key=lambda n: (share[n] / copies[n], n)):
                for v in range(self.num_workers):
                    if v != w and self.room(v, other) and self.room(w, name, freed=other):
                        held[w].remove(other)
                        held_sets[w].discard(other)
                        self.held_bytes[w] -= self.size[other]
                        self.load[w] -= share[other] / copies[other]
                        self.put(v, other, share[other] / copies[other])
                        return w
        return None


def _single_copy_warnings(names: Sequence[str], share: Mapping[str, float], copies: Mapping[str, int], target: int) -> list[str]:
    single = [n for n in names if copies[n] < target]
    if not single:
        return []
    coldest = ", ".join(sorted(single, key=lambda n: (share[n], n))[:5])
    return [f"no room for a second copy of {len(single)} adapter(s) (coldest: {coldest}): "
            "one replica's failure makes them unavailable"]


def _shards(held: Sequence[Sequence[str]], order: Sequence[str], load: Sequence[float]) -> tuple[Shard, ...]:
    """Workers with the same set are one shard (after the swaps, only when nothing could differ),
    numbered by their first worker; each shard's adapters hottest first."""
    groups: dict[tuple[str, ...], list[int]] = {}
    rank = {n: i for i, n in enumerate(order)}
    for w, names in enumerate(held):
        groups.setdefault(tuple(sorted(names, key=rank.__getitem__)), []).append(w)
    return tuple(
        Shard(f"shard-{i}", adapters_, len(workers), load[workers[0]])
        for i, (adapters_, workers) in enumerate(sorted(groups.items(), key=lambda g: g[1][0]))
    )


def _separate_identical_sets(held: list[list[str]], held_bytes: list[int], load: list[float],
                             per_copy: dict[str, float], size: dict[str, int], max_bytes: int | None) -> None:
    for _ in range(4 * len(held) ** 2):  # bounded; each swap makes one worker's set unique
        seen: dict[frozenset[str], int] = {}
        twin = None
        for w, names in enumerate(held):
            key = frozenset(names)
            if key in seen:
                twin = w
                break
            seen[key] = w
        if twin is None:
            return
        best = None
        for a in held[twin]:
            for x, other in enumerate(held):
                if frozenset(other) == frozenset(held[twin]) or a in other:
                    continue
                for b in other:
                    if b in held[twin]:
                        continue
                    if max_bytes is not None and max(held_bytes[twin] - size[a] + size[b],
                                                     held_bytes[x] - size[b] + size[a]) > max_bytes:
                        continue
                    cost = (abs(per_copy[a] - per_copy[b]), per_copy[a] + per_copy[b], a, b, x)
                    if best is None or cost < best:
                        best = cost
        if best is None:
            return  # nothing to swap: they stay replicas of one shard
        _, _, a, b, x = best
        held[twin][held[twin].index(a)], held[x][held[x].index(b)] = b, a
        held_bytes[twin] += size[b] - size[a]
        held_bytes[x] += size[a] - size[b]
        load[twin] += per_copy[b] - per_copy[a]
        load[x] += per_copy[a] - per_copy[b]


def zipf_shares(names: Sequence[str], s: float) -> dict[str, float]:
    """Zipf(s) over `names` in order: the k-th gets 1 / k^s (normalized)."""
    weights = {n: 1.0 / (k + 1) ** s for k, n in enumerate(names)}
    total = sum(weights.values())
    return {n: w / total for n, w in weights.items()}


def place_new(pinned: Mapping[str, int], replicas: Mapping[str, int], copies: int, capacity: int) -> tuple[str, ...]:
    """Shards for an adapter registered while running: the ones pinning the fewest adapters
    (ties by name) among those with room, until `copies` replicas hold it (so one replica's
    failure leaves it servable) or every shard with room does. Shards with replicas come first:
    one with none now (an autoscaled shard asleep) only where they do not reach `copies`."""
    room = sorted((s for s in pinned if pinned[s] < capacity), key=lambda s: (replicas[s] == 0, pinned[s], s))
    if not room:
        raise PlacementError(f"every worker already holds its limit of {capacity} adapters")
    chosen: list[str] = []
    for shard in room:
        chosen.append(shard)
        if sum(replicas[s] for s in chosen) >= copies:
            break
    return tuple(chosen)


BALANCE_SLACK = 0.25  # a re-plan keeps each shard's expected load per replica within (1 + this) x the mean


def rebalance(placed: Mapping[Fingerprint, tuple[str, ...]], traffic: Mapping[Fingerprint, float],
              replicas: Mapping[str, int], copies: int, capacity: int,
              fixed: Mapping[str, int] | None = None) -> dict[Fingerprint, tuple[str, ...]]:
    """Pins to move while running, from recent traffic (fingerprint -> requests), hottest adapter
    first: one whose share of the traffic is more than its share of the replicas holding it, or
    held by a shard whose expected load per replica is past (1 + BALANCE_SLACK) x the mean, gets
    one more shard (the least loaded with room; for the bound, when that shard stays within it and
    the copy takes at least 5% of it off the others); one held by more replicas than its traffic and
    the redundancy need loses its most loaded shard when that shard is at its capacity (elsewhere a
    spare copy costs nothing and absorbs the next shift) or when nothing asked for it lately (it
    cooled: the copies its traffic won go back), unless its traffic would then push another
    of its shards past that bound. (Dropping copies by traffic alone packed hot adapters together:
    the fleet simulator showed TTFT p99 going from 0.25 s to 14 s.) At most one change per adapter per call, so pins move
    gradually; returns only the adapters that change. `fixed`: adapters per shard that do not move
    (the config's), counted against its capacity. `replicas`: each shard's replicas now; one with
    none (an autoscaled shard asleep) takes no requests and no new copy, so an adapter held only
    there and still asked for gets a copy on a shard that serves."""
    total_traffic = sum(traffic.get(a, 0.0) for a in placed)
    total_replicas = sum(replicas.values())
    if total_traffic <= 0 or total_replicas <= 1:
        return {}
    bound = (1 + BALANCE_SLACK) * total_traffic / total_replicas
    pinned = {s: sum(s in shards for shards in placed.values()) + (fixed or {}).get(s, 0) for s in replicas}
    load = dict.fromkeys(replicas, 0.0)  # expected requests per replica of each shard
    for a, shards in placed.items():
        per_replica = traffic.get(a, 0.0) / max(sum(replicas[s] for s in shards), 1)
        for s in shards:
            load[s] += per_replica if replicas[s] else 0.0
    changes: dict[Fingerprint, tuple[str, ...]] = {}
    for fingerprint in sorted(placed, key=lambda a: (-traffic.get(a, 0.0), a)):
        shards, share = placed[fingerprint], traffic.get(fingerprint, 0.0)
        holding = sum(replicas[s] for s in shards)
        per_replica = share / max(holding, 1)
        wanted = share / total_traffic * total_replicas  # the replicas its share of the traffic deserves
        hottest = max((load[s] for s in shards), default=0.0)
        if share > 0 and (wanted > holding + 0.5 or hottest > bound or holding == 0):
            room = sorted((s for s in replicas if s not in shards and pinned[s] < capacity and replicas[s]),
                          key=lambda s: (load[s], s))
            if room:
                new = room[0]
                spread = share / (holding + replicas[new])
                # for an overloaded shard: a copy that takes a real part of its load off and stays in bound itself
                relieves = per_replica - spread >= 0.05 * bound and load[new] + spread <= bound
                if wanted > holding + 0.5 or relieves or holding == 0:
                    changes[fingerprint] = (*shards, new)
                    pinned[new] += 1
                    _shift(load, replicas, shards, spread - per_replica)
                    load[new] += spread
        elif len(shards) > 1:
            drop = max(shards, key=lambda s: (load[s], s))
            left = holding - replicas[drop]
            # a spare copy stays where it costs nothing, until its adapter is asked for no more (cooled)
            if (pinned[drop] >= capacity or share == 0) and left >= max(copies, wanted + 0.5):
                spread = share / left
                if all(load[s] + spread - per_replica <= bound for s in shards if s != drop):
                    changes[fingerprint] = tuple(s for s in shards if s != drop)
                    pinned[drop] -= 1
                    _shift(load, replicas, (drop,), -per_replica)
                    _shift(load, replicas, changes[fingerprint], spread - per_replica)
    return changes


def _shift(load: dict[str, float], replicas: Mapping[str, int], shards: Sequence[str], delta: float) -> None:
    """Add `delta` to the expected load per replica of those of `shards` that have replicas."""
    for s in shards:
        if replicas[s]:
            load[s] += delta
