"""Prefix-cache counters and their Prometheus text form (torch-free)."""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

LOOKUP_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)


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

    def prometheus(self, name: str, help_text: str | None, labels: str = "") -> list[str]:
        """Its lines; `labels` ('tier="disk"') for one series of a labelled histogram, `help_text`
        None for every series after the first (its HELP and TYPE are written once)."""
        lines = [] if help_text is None else [f"# HELP {name} {help_text}", f"# TYPE {name} histogram"]
        running = 0
        others = f"{labels}," if labels else ""
        for bound, count in zip((*self.buckets, float("inf")), self.counts):
            running += count
            le = "+Inf" if bound == float("inf") else repr(bound)
            lines.append(f'{name}_bucket{{{others}le="{le}"}} {running}')
        tail = f"{{{labels}}}" if labels else ""
        lines += [f"{name}_sum{tail} {self.total!r}", f"{name}_count{tail} {self.num}"]
        return lines


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
    lines = []
    for name, attr, help_text in _COUNTERS:
        lines += [f"# HELP loraplex_cache_{name} {help_text}", f"# TYPE loraplex_cache_{name} counter",
                  f"loraplex_cache_{name} {getattr(stats, attr)}"]
    lines += [
        "# HELP loraplex_cache_hit_chunks_total chunks found, by tier",
        "# TYPE loraplex_cache_hit_chunks_total counter",
        f'loraplex_cache_hit_chunks_total{{tier="l1"}} {stats.num_chunks_hit_l1}',
        f'loraplex_cache_hit_chunks_total{{tier="l2"}} {stats.num_chunks_hit_l2}',
        "# HELP loraplex_cache_redis_errors_total failed Redis calls",
        "# TYPE loraplex_cache_redis_errors_total counter",
        f"loraplex_cache_redis_errors_total {redis_errors}",
        "# HELP loraplex_cache_redis_round_trips_total Redis calls made",
        "# TYPE loraplex_cache_redis_round_trips_total counter",
        f"loraplex_cache_redis_round_trips_total {redis_round_trips}",
        "# HELP loraplex_cache_l1_bytes bytes held by the worker-local tier",
        "# TYPE loraplex_cache_l1_bytes gauge",
        f"loraplex_cache_l1_bytes {l1_bytes}",
        "# HELP loraplex_cache_redis_state 1 for the current state of the shared tier (ok, degraded: breaker open, off)",
        "# TYPE loraplex_cache_redis_state gauge",
        *(f'loraplex_cache_redis_state{{state="{s}"}} {int(s == redis_state)}' for s in ("ok", "degraded", "off")),
    ]
    lines += stats.lookup_s.prometheus("loraplex_cache_lookup_seconds", "time to look up a prompt's chunks (L1 and Redis)")
    return "\n".join(lines) + "\n"
