"""The counters of a replica's adapter tiers (worker/shard/metrics.py reports them): promotions and
their load times by the tier an adapter came from, evictions (and the bytes freed) by the tier it left."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from cache.stats import Histogram

TIERS = ("device", "host", "disk", "store")
LOAD_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


@dataclass
class ResidencyStats:
    promotions: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TIERS[1:], 0))  # by the tier it came from
    evictions: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TIERS[:3], 0))  # by the tier it left
    evicted_bytes: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TIERS[:2], 0))  # the bytes that left device and host
    load_s: dict[str, Histogram] = field(default_factory=lambda: {t: Histogram(LOAD_BUCKETS_S) for t in TIERS[1:]})
    waited: int = 0  # requests that waited for an adapter to come up
    recent_load_s: deque[float] = field(default_factory=lambda: deque(maxlen=10_000))  # the last promotions' times (benchmarks)

    def promoted(self, source: str, seconds: float) -> None:
        self.promotions[source] += 1
        self.load_s[source].observe(seconds)
        self.recent_load_s.append(seconds)
