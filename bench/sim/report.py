"""A run's figures (per router) and the table that compares them."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from bench.sim.record import RunRecord


@dataclass(frozen=True)
class SLO:
    ttft_s: float
    itl_s: float


def percentile(values: Sequence[float], q: float) -> float:
    """The q-quantile (nearest rank); NaN when there are none."""
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def _bucket_percentile(buckets: dict[int, int], q: float) -> float:
    total = sum(buckets.values())
    if not total:
        return math.nan
    seen = 0
    for bucket in sorted(buckets):
        seen += buckets[bucket]
        if seen >= q * total:
            return bucket / 1e4
    return max(buckets) / 1e4


def figures(record: RunRecord, slo: SLO, measured_s: float) -> dict[str, float | int | str]:
    is_good = [ttft <= slo.ttft_s and itl <= slo.itl_s for ttft, itl in zip(record.ttft_s, _itl_or_zero(record))]
    good = sum(is_good)
    rate_refused = sum(outcomes["refused_rate"] for outcomes in record.measured.values())
    admitted = record.num_measured - rate_refused  # a tenant's rate limit refuses what no replica count would serve
    duration_s = max(record.end_s, 1e-9)
    busy = sum(record.busy_s) / len(record.busy_s) / duration_s  # share of time a replica is stepping at all
    utilisation = [slot_s / duration_s / record.num_seq_slots for slot_s in record.slot_s]  # KV slots in use
    mean_util = sum(utilisation) / len(utilisation)
    return {
        "router": record.router,
        "replicas": record.num_replicas,
        **record.outcomes,
        "failed": record.outcomes["failed_no_replica"] + record.outcomes["failed_too_long"] + record.outcomes["failed_replica_lost"],
        "measured": record.num_measured,
        "goodput_rps": good / measured_s,
        "goodput_share": good / record.num_measured if record.num_measured else math.nan,
        "good_admitted_share": good / admitted if admitted else math.nan,
        "ttft_p50_s": percentile(record.ttft_s, 0.5),
        "ttft_p99_s": percentile(record.ttft_s, 0.99),
        "itl_p50_s": percentile(record.itl_s, 0.5),  # per request: its mean gap
        "itl_p99_s": percentile(record.itl_s, 0.99),
        "gap_p99_s": _bucket_percentile(record.gaps, 0.99),  # every gap between two tokens
        "queue_p50_s": percentile(record.queue_s, 0.5),
        "queue_p99_s": percentile(record.queue_s, 0.99),
        "prefix_hit_rate": record.cached_tokens / record.prompt_tokens if record.prompt_tokens else math.nan,
        "busy_mean": busy,
        "util_mean": mean_util,
        "util_min": min(utilisation),
        "util_max": max(utilisation),
        "util_max_over_mean": max(utilisation) / mean_util if mean_util > 0 else math.nan,
        "adapter_loads": record.num_adapter_loads,
        "adapter_loads_lower": record.num_lower_loads,
        "adapter_loads_per_min": record.num_adapter_loads / duration_s * 60,
        "adapter_evictions_per_min": record.num_adapter_evictions / duration_s * 60,
        "tenants": _per_tenant(record, is_good),
        "fetched_tokens": record.fetched_tokens,
        "replans": record.num_replans,
        "pins_moved": record.num_pins_moved,
        "new_versions": record.num_new_versions,
        "unplaced_versions": record.num_unplaced,
        "events": record.num_events,
    }


def _per_tenant(record: RunRecord, is_good: Sequence[bool]) -> dict[str, dict[str, float | int]]:
    """Each tenant's measured requests, their share that met the SLO (of those the rate limits let
    in), and TTFT p50 and p99: what one tenant's burst does to the others."""
    ttft: dict[str, list[float]] = {}
    good: dict[str, int] = {}
    for tenant, value, ok in zip(record.tenants, record.ttft_s, is_good):
        ttft.setdefault(tenant, []).append(value)
        good[tenant] = good.get(tenant, 0) + ok
    result: dict[str, dict[str, float | int]] = {}
    for tenant, outcomes in sorted(record.measured.items()):
        admitted = sum(outcomes.values()) - outcomes["refused_rate"]
        result[tenant] = {"measured": sum(outcomes.values()), "refused_rate": outcomes["refused_rate"],
                          "good_admitted_share": good.get(tenant, 0) / admitted if admitted else math.nan,
                          "ttft_p50_s": percentile(ttft.get(tenant, []), 0.5),
                          "ttft_p99_s": percentile(ttft.get(tenant, []), 0.99)}
    return result


def _itl_or_zero(record: RunRecord) -> list[float]:
    """ITL per completed request, aligned with ttft_s (one-token requests have no gap: 0)."""
    if len(record.itl_s) == len(record.ttft_s):
        return record.itl_s
    return record.itl_s + [0.0] * (len(record.ttft_s) - len(record.itl_s))


COLUMNS = [
    ("router", "router", "{}"), ("completed", "done", "{}"), ("refused_rate", "429", "{}"), ("refused_busy", "503", "{}"),
    ("failed", "failed", "{}"), ("goodput_rps", "goodput/s", "{:.2f}"), ("goodput_share", "good%", "{:.1%}"),
    ("ttft_p50_s", "TTFT p50", "{:.3f}"), ("ttft_p99_s", "TTFT p99", "{:.3f}"), ("itl_p50_s", "ITL p50", "{:.4f}"),
    ("itl_p99_s", "ITL p99", "{:.4f}"), ("queue_p50_s", "queue p50", "{:.3f}"), ("queue_p99_s", "queue p99", "{:.3f}"),
    ("prefix_hit_rate", "prefix hit", "{:.1%}"), ("busy_mean", "busy", "{:.0%}"), ("util_mean", "slots", "{:.1%}"),
    ("util_min", "slots min", "{:.1%}"),
    ("util_max", "slots max", "{:.1%}"), ("adapter_loads", "loads", "{}"), ("adapter_loads_per_min", "loads/min", "{:.0f}"),
    ("adapter_evictions_per_min", "evictions/min", "{:.0f}"),
]


def tenant_table(rows: Sequence[dict]) -> str:
    """Per router and tenant: the share that met the SLO of those admitted, and TTFT p50/p99."""
    lines = ["router                     tenant       measured   429  good (admitted)  TTFT p50  TTFT p99"]
    for row in rows:
        for tenant, t in row["tenants"].items():
            lines.append(f"{row['router']:26} {tenant:12} {t['measured']:8} {t['refused_rate']:5} {t['good_admitted_share']:16.1%}"
                         f"  {t['ttft_p50_s']:8.3f}  {t['ttft_p99_s']:8.3f}")
    return "\n".join(lines)


def table(rows: Sequence[dict[str, float | int | str]]) -> str:
    cells = [[title for _, title, _ in COLUMNS]]
    for row in rows:
        cells.append([fmt.format(row[key]) for key, _, fmt in COLUMNS])
    widths = [max(len(line[i]) for line in cells) for i in range(len(COLUMNS))]
    return "\n".join("  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(line, widths))) for line in cells)
