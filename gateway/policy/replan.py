"""Placement while running (torch-free, pure): where an adapter registered at run time is pinned
(`place_new`), and the re-plan that moves registered adapters' pins with the traffic (`rebalance`).
The deployment's first placement, from traffic shares, is gateway/policy/placement.py's `plan`; the
registry calls these (gateway/registry/live_placement.py), and the fleet simulator runs them as they are."""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence

from gateway.policy.placement import PlacementError
from worker.contract.identity import Fingerprint


def place_new(pinned: Mapping[str, int], replicas: Mapping[str, int], copies: int, capacity: int,
              now: Mapping[str, int] | None = None) -> tuple[str, ...]:
    """Shards for an adapter registered while running: the ones pinning the fewest adapters
    (ties by name) among those with room, until `copies` replicas hold it (so one replica's
    failure leaves it servable) or every shard with room does. `replicas`: what each shard keeps
    (what redundancy counts on); `now`: its replicas now (default: the same), shards with none
    (autoscaled, asleep) last."""
    now = replicas if now is None else now
    room = sorted((s for s in pinned if pinned[s] < capacity), key=lambda s: (now[s] == 0, pinned[s], s))
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
              replicas: Mapping[str, int], copies: int, capacity: int, fixed: Mapping[str, int] | None = None,
              kept: Mapping[str, int] | None = None, cooled: Collection[Fingerprint] = ()) -> dict[Fingerprint, tuple[str, ...]]:
    """Pins to move while running, from recent traffic (fingerprint -> requests), hottest adapter
    first: one whose share of the traffic is more than its share of the replicas holding it, or
    held by a shard whose expected load per replica is past (1 + BALANCE_SLACK) x the mean, gets
    one more shard (the least loaded with room; for the bound, when that shard stays within it and
    the copy takes at least 5% of it off the others); one held by more replicas than its traffic and
    the redundancy need loses its most loaded shard when that shard is at its capacity (elsewhere a
    spare copy costs nothing and absorbs the next shift) or when it is in `cooled` (asked for no
    more: the copies its traffic won go back), unless its traffic would then push another of its
    shards past that bound. (Dropping copies by traffic alone packed hot adapters together: the
    fleet simulator showed TTFT p99 going from 0.25 s to 14 s.) At most one change per adapter per
    call, so pins move gradually; returns only the adapters that change.

    `fixed`: adapters per shard that do not move (the config's), counted against its capacity.
    `replicas`: each shard's replicas now, which take its traffic; one with none (an autoscaled shard
    asleep) is given no copy, and an adapter held only where none run and still asked for gets a copy
    on a shard that serves (where it stays within the bound). `kept`: the replicas each shard keeps
    (default: `replicas`), what the redundancy need counts on."""
    total_traffic = sum(traffic.get(a, 0.0) for a in placed)
    total_replicas = sum(replicas.values())
    if total_traffic <= 0 or total_replicas == 0:
        return {}
    replan = _Replan(placed, traffic, replicas, capacity, fixed or {}, (1 + BALANCE_SLACK) * total_traffic / total_replicas)
    changes: dict[Fingerprint, tuple[str, ...]] = {}
    for fingerprint in sorted(placed, key=lambda a: (-traffic.get(a, 0.0), a)):
        share, holding = traffic.get(fingerprint, 0.0), replan.holding(fingerprint)
        wanted = share / total_traffic * total_replicas  # the replicas its share of the traffic deserves
        if share > 0 and (wanted > holding + 0.5 or replan.hottest(fingerprint) > replan.bound or holding == 0):
            change = replan.add_copy(fingerprint, must=wanted > holding + 0.5)
        elif len(placed[fingerprint]) > 1:
            redundant = kept or replicas
            change = replan.drop_copy(fingerprint, lambda left: sum(redundant[s] for s in left) >= copies
                                      and sum(replicas[s] for s in left) >= wanted + 0.5, fingerprint in cooled)
        else:
            change = None
        if change is not None:
            changes[fingerprint] = change
    return changes


class _Replan:
    """The expected load per replica of each shard, and its pins, as a re-plan's changes move them."""

    def __init__(self, placed: Mapping[Fingerprint, tuple[str, ...]], traffic: Mapping[Fingerprint, float],
                 replicas: Mapping[str, int], capacity: int, fixed: Mapping[str, int], bound: float) -> None:
        self.placed, self.traffic, self.replicas, self.capacity, self.bound = dict(placed), traffic, replicas, capacity, bound
        self.pinned = {s: sum(s in shards for shards in placed.values()) + fixed.get(s, 0) for s in replicas}
        self.load = dict.fromkeys(replicas, 0.0)  # expected requests per replica of each shard
        for a, shards in placed.items():
            _shift(self.load, replicas, shards, self.per_replica(a))

    def holding(self, fingerprint: Fingerprint) -> int:
        return sum(self.replicas[s] for s in self.placed[fingerprint])

    def per_replica(self, fingerprint: Fingerprint) -> float:
        return self.traffic.get(fingerprint, 0.0) / max(self.holding(fingerprint), 1)

    def hottest(self, fingerprint: Fingerprint) -> float:
        return max((self.load[s] for s in self.placed[fingerprint]), default=0.0)

    def add_copy(self, fingerprint: Fingerprint, must: bool) -> tuple[str, ...] | None:
        """One more shard for `fingerprint`, the least loaded with replicas and room: where its share asks
        for it (`must`), where none of its shards serves and the copy stays in bound, or where it takes a
        real part of an overloaded shard's load off and stays in bound itself."""
        shards, holding, per_replica = self.placed[fingerprint], self.holding(fingerprint), self.per_replica(fingerprint)
        room = sorted((s for s in self.replicas if s not in shards and self.pinned[s] < self.capacity and self.replicas[s]),
                      key=lambda s: (self.load[s], s))
        if not room:
            return None
        new = room[0]
        spread = self.traffic.get(fingerprint, 0.0) / (holding + self.replicas[new])
        fits = self.load[new] + spread <= self.bound
        if not (must or (fits and (holding == 0 or per_replica - spread >= 0.05 * self.bound))):
            return None
        _shift(self.load, self.replicas, shards, spread - per_replica)
        self.load[new] += spread
        self.pinned[new] += 1
        self.placed[fingerprint] = (*shards, new)
        return self.placed[fingerprint]

    def drop_copy(self, fingerprint: Fingerprint, enough: Callable[[tuple[str, ...]], bool],
                  is_cooled: bool) -> tuple[str, ...] | None:
        """`fingerprint`'s most loaded shard taken off, where that shard needs the room or the adapter
        cooled, the shards left are `enough`, and none of them goes past the bound with its traffic."""
        shards, per_replica = self.placed[fingerprint], self.per_replica(fingerprint)
        drop = max(shards, key=lambda s: (self.load[s], s))
        left = tuple(s for s in shards if s != drop)
        if not ((self.pinned[drop] >= self.capacity or is_cooled) and enough(left)):
            return None
        spread = self.traffic.get(fingerprint, 0.0) / max(sum(self.replicas[s] for s in left), 1)
        if any(self.load[s] + spread - per_replica > self.bound for s in left if self.replicas[s]):
            return None
        _shift(self.load, self.replicas, (drop,), -per_replica)
        _shift(self.load, self.replicas, left, spread - per_replica)
        self.pinned[drop] -= 1
        self.placed[fingerprint] = left
        return left


def _shift(load: dict[str, float], replicas: Mapping[str, int], shards: Sequence[str], delta: float) -> None:
    """Add `delta` to the expected load per replica of those of `shards` that have replicas."""
    for s in shards:
        if replicas[s]:
            load[s] += delta
