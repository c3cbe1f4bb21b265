"""Prefix-cache counters, the plain histogram the engine and a replica's adapter tiers keep too,
and how they show as Prometheus metrics (torch-free).

The counts stay plain data, written by one thread and read from any; a scrape turns them into
`prometheus_client` metric families and renders those through a registry of its own, never the
process-wide default one, so several caches or engines in one process never collide.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.utils import floatToGoString

LOOKUP_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
REDIS_STATES = ("ok", "degraded", "off")
F = TypeVar("F", CounterMetricFamily, GaugeMetricFamily)


@dataclass
class Histogram:
    buckets: tuple[float, ...] = LOOKUP_BUCKETS_S
    counts: list[int] = field(default_factory=list)  # one per bucket, the last +Inf
    total: float = 0.0
    num: int = 0

    def __post_init__(self) -> None:
        if not self.counts:
            self.counts = [0] * (len(self.buckets) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.total += value
        self.num += 1

    def add_to(self, family: HistogramMetricFamily, labels: Sequence[str] = ()) -> HistogramMetricFamily:
        """`family` with this histogram as one more series; `labels`: its values of the family's label names."""
        bounds = (*(floatToGoString(b) for b in self.buckets), "+Inf")
        family.add_metric(list(labels), list(zip(bounds, itertools.accumulate(self.counts))), self.total)
        return family


def labelled(family: F, values: Mapping[str, float]) -> F:
    """`family` (with one label name) with a series for each label value in `values`."""
    for label, value in values.items():
        family.add_metric([label], value)
    return family


class _Families:
    """A collector of metric families already built (one scrape's)."""

    def __init__(self, families: Iterable[Metric]) -> None:
        self._families = list(families)

    def collect(self) -> Iterator[Metric]:
        return iter(self._families)


def exposition(families: Iterable[Metric]) -> str:
    """`families` in Prometheus' text format, rendered through a registry of their own."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(families))
    return generate_latest(registry).decode()


@dataclass
class CacheStats:
    num_lookups: int = 0
    num_lookups_hit: int = 0  # lookups that found at least one chunk
    num_chunks_hit_l1: int = 0
    num_chunks_hit_l2: int = 0
    num_chunks_missed: int = 0
    num_tokens_hit: int = 0
    num_bytes_read_l2: int = 0
    num_chunks_stored: int = 0
    num_bytes_written_l2: int = 0
    num_corrupt: int = 0  # values that failed to parse or verify: deleted, never used
    num_writes_dropped: int = 0  # the writer's queue was full
    num_store_errors: int = 0
    lookup_s: Histogram = field(default_factory=Histogram)

    def snapshot(self) -> dict[str, float | int]:
        out = {k: v for k, v in vars(self).items() if isinstance(v, int | float)}
        out["lookup_s_sum"], out["lookup_s_count"] = self.lookup_s.total, self.lookup_s.num
        return out


_COUNTERS = (
    ("lookups_total", "num_lookups", "prefix lookups"),
    ("lookup_hits_total", "num_lookups_hit", "lookups that found at least one chunk"),
    ("chunks_missed_total", "num_chunks_missed", "chunks looked up and not found"),
    ("hit_tokens_total", "num_tokens_hit", "prompt tokens served from the cache"),
    ("read_bytes_total", "num_bytes_read_l2", "bytes read from Redis"),
    ("stored_chunks_total", "num_chunks_stored", "new chunks stored"),
    ("written_bytes_total", "num_bytes_written_l2", "bytes written to Redis"),
    ("corrupt_values_total", "num_corrupt", "values that failed to parse or verify (deleted, not used)"),
    ("writes_dropped_total", "num_writes_dropped", "chunk writes dropped because the writer was behind"),
    ("store_errors_total", "num_store_errors", "chunks that could not be extracted or stored"),
)


def prometheus_text(stats: CacheStats, *, l1_bytes: int, redis_state: str, redis_errors: int, redis_round_trips: int) -> str:
    """The `loraplex_cache_*` metrics in Prometheus' text format."""
    families: list[Metric] = [CounterMetricFamily(f"loraplex_cache_{name}", help_text, getattr(stats, attr))
                              for name, attr, help_text in _COUNTERS]
    families += [
        labelled(CounterMetricFamily("loraplex_cache_hit_chunks_total", "chunks found, by tier", labels=("tier",)),
                 {"l1": stats.num_chunks_hit_l1, "l2": stats.num_chunks_hit_l2}),
        CounterMetricFamily("loraplex_cache_redis_errors_total", "failed Redis calls", redis_errors),
        CounterMetricFamily("loraplex_cache_redis_round_trips_total", "Redis calls made", redis_round_trips),
        GaugeMetricFamily("loraplex_cache_l1_bytes", "bytes held by the worker-local tier", l1_bytes),
        labelled(GaugeMetricFamily("loraplex_cache_redis_state", "1 for the current state of the shared tier "
                                   "(ok, degraded: breaker open, off)", labels=("state",)),
                 {s: int(s == redis_state) for s in REDIS_STATES}),
        stats.lookup_s.add_to(HistogramMetricFamily("loraplex_cache_lookup_seconds",
                                                    "time to look up a prompt's chunks (L1 and Redis)")),
    ]
    return exposition(families)
