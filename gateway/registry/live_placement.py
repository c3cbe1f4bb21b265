"""Where the registry pins registered adapters, over the replicas each shard has now (torch-free).

The decisions are gateway/policy/replan.py's pure `place_new` and `rebalance`; this module
gives them the replicas each shard has, two ways:

- its replicas now, for where the traffic goes: a fixed shard's configured count; an autoscaled
  shard's replicas Serve runs or starts (gateway/cluster/membership.py; its config's `replicas`
  is only its maximum), 0 while it sleeps;
- the replicas it keeps, for redundancy (`registry.copies`): a fixed shard's count, an autoscaled
  one's `min_replicas`, at least 1 (one asleep gets a replica when asked). A copy counted on a
  scale-up's replicas would be gone when the shard scales back down.

So a shard scaled up for a hot adapter counts each new replica as a copy of it for the traffic,
and the re-plan gives a hot adapter a copy on another shard when its own shard has fewer replicas
than its share of the traffic (scaled down, or asleep). A shard asleep is given no copy by the
re-plan, and a new adapter goes first to shards with replicas, so one loads it at once. An
adapter asked for while every shard holding it sleeps gets a copy on a shard that serves, where
that shard stays within the balance bound: its next requests need no cold start, and its own
shard serves it again once awake.

A re-plan gives a cooled adapter's extra copies back (down to `registry.copies`) only after
COOLED_REPLANS re-plans in a row without a request for it since the one before: the re-plan sees one
gateway's traffic, and with several gateway replicas an adapter the others serve may look idle to it.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence

from gateway.cluster.membership import STARTING, UP
from gateway.cluster.pool import ReplicaInfo
from gateway.config import ServeConfig
from gateway.policy.replan import place_new, rebalance
from worker.contract.identity import Fingerprint

Phase = Callable[[str], str]  # replica id -> up, starting, draining or asleep (the pool's; a fixed shard's: up)
COOLED_REPLANS = 3


class LivePlacement:
    """The registry's placement decisions for the shards as they are now (the config, its replicas, and
    which of them serve)."""

    def __init__(self, config: ServeConfig, replicas: Sequence[ReplicaInfo], phase: Phase | None = None) -> None:
        self.config, self.replicas, self.phase = config, replicas, phase
        self.settings = config.registry
        self.idle_replans: dict[Fingerprint, int] = {}  # re-plans in a row without a request for the adapter

    def is_up(self, replica_id: str) -> bool:
        return self.phase is None or self.phase(replica_id) == UP

    def num_replicas_now(self) -> dict[str, int]:
        """Replicas per shard now: a fixed shard's configured count; an autoscaled shard's replicas that
        run or start (all it may have where the pool cannot say)."""
        counts: dict[str, int] = {}
        for shard in self.config.shards:
            if shard.autoscaling is None or self.phase is None:
                counts[shard.name] = shard.replicas
            else:  # one starting takes its shard's pins when it comes up
                counts[shard.name] = sum(1 for r in self.replicas
                                         if r.shard == shard.name and self.phase(r.replica_id) in (UP, STARTING))
        return counts

    def num_replicas_kept(self) -> dict[str, int]:
        """Replicas per shard that redundancy may count on: a fixed shard's count, an autoscaled shard's
        min_replicas, at least 1."""
        return {s.name: s.replicas if s.autoscaling is None else max(s.autoscaling.min_replicas, 1) for s in self.config.shards}

    def for_new(self, pinned: Mapping[str, int]) -> tuple[str, ...]:
        """Shards for a new adapter (`pinned`: adapters per shard now): PlacementError when none has room."""
        return place_new(pinned, self.num_replicas_kept(), self.settings.copies, self.settings.max_adapters_per_worker,
                         self.num_replicas_now())

    def moves(self, placed: Mapping[Fingerprint, tuple[str, ...]], traffic: Mapping[Fingerprint, float],
              fixed: Mapping[str, int], asked: Collection[Fingerprint]) -> dict[Fingerprint, tuple[str, ...]]:
        """Pins to move for the traffic seen (decayed), `asked`: the adapters requested since the last
        re-plan (`fixed`: the config's adapters per shard, which do not move)."""
        self.idle_replans = {fp: 0 if fp in asked else self.idle_replans.get(fp, 0) + 1 for fp in placed}
        cooled = {fp for fp, n in self.idle_replans.items() if n >= COOLED_REPLANS}
        return rebalance(placed, traffic, self.num_replicas_now(), self.settings.copies,
                         self.settings.max_adapters_per_worker, fixed, kept=self.num_replicas_kept(), cooled=cooled)
