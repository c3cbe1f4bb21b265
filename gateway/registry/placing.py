"""Where the registry pins registered adapters, over the replicas that serve now (torch-free).

The decisions are gateway/policy/placement.py's pure `place_new` and `rebalance`; this module
gives them the replicas each shard has. A fixed shard has the replicas its config names. An
autoscaled shard has the ones Serve's autoscaling runs now (gateway/cluster/membership.py): its
config's `replicas` is only its maximum. So:

- a shard that scaled up for a hot adapter counts every new replica as a copy of it; a shard
  scaled down counts fewer, and the re-plan gives its hot adapters copies on other shards;
- a new adapter goes first to shards that serve now, so a replica loads it at once (one asleep
  could not, and the registration would wait out its load timeout);
- a shard asleep (min_replicas 0) is given no new copies; an adapter asked for while all its
  shards sleep gets a copy on a shard that serves, so its next requests need no cold start;
  its own shard keeps its pins and serves it again once awake.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from gateway.cluster.pool import ReplicaInfo
from gateway.config import ServeConfig
from gateway.policy.placement import place_new, rebalance
from worker.contract.identity import Fingerprint

Serving = Callable[[str], bool]  # replica id -> whether it serves now (up: routed to)


class Placing:
    def __init__(self, config: ServeConfig, replicas: Sequence[ReplicaInfo], serving: Serving | None = None) -> None:
        self.config, self.replicas, self.serving = config, replicas, serving
        self.settings = config.registry

    def serves(self, replica_id: str) -> bool:
        return self.serving is None or self.serving(replica_id)

    def live_replicas(self) -> dict[str, int]:
        """Replicas per shard now: a fixed shard's configured count; an autoscaled shard's replicas up
        (all it may have where the pool cannot say)."""
        counts: dict[str, int] = {}
        for shard in self.config.shards:
            if shard.autoscaling is None or self.serving is None:
                counts[shard.name] = shard.replicas
            else:
                counts[shard.name] = sum(1 for r in self.replicas if r.shard == shard.name and self.serving(r.replica_id))
        return counts

    def for_new(self, pinned: Mapping[str, int]) -> tuple[str, ...]:
        """Shards for a new adapter (`pinned`: adapters per shard now): PlacementError when none has room."""
        return place_new(pinned, self.live_replicas(), self.settings.copies, self.settings.max_adapters_per_worker)

    def moves(self, placed: Mapping[Fingerprint, tuple[str, ...]], traffic: Mapping[Fingerprint, float],
              fixed: Mapping[str, int]) -> dict[Fingerprint, tuple[str, ...]]:
        """Pins to move for the traffic seen (`fixed`: the config's adapters per shard, which do not move)."""
        return rebalance(placed, traffic, self.live_replicas(), self.settings.copies,
                         self.settings.max_adapters_per_worker, fixed)
