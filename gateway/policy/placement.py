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
Deterministic: ties break by adapter name and worker index. Placement while running (a new
adapter's shards, the re-plan) is gateway/policy/replan.py's.
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping, Sequence
from dataclasses import dataclass



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
