"""`loraplex simulate --out DIR`: the run's report in the load tester's style (report.json,
report.md and PNG plots), one line or bar per router."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.sim.record import RunRecord
from bench.sim.report import table, tenant_table
from gateway.loadtest.report import PNGs

WINDOW_S = 30.0  # the plots over time: one point per window


def write_report(out: Path, what: str, rows: Sequence[dict[str, Any]], records: Sequence[RunRecord]) -> list[str]:
    """report.json (the rows), report.md (the tables) and the plots; the files written."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(json.dumps({"what": what, "rows": list(rows)}, indent=1, default=float))
    names = plots(rows, records, out)
    (out / "report.md").write_text(f"# {what}\n\n```\n{table(rows)}\n\n{tenant_table(rows)}\n```\n\n"
                                   + "".join(f"![{n}]({n})\n" for n in names))
    return ["report.json", "report.md", *names]


def _windows(times: Sequence[float], values: Sequence[float], end_s: float, q: float) -> tuple[list[float], list[float]]:
    """The q-quantile of `values` per WINDOW_S of `times` (windows with none left out)."""
    buckets: dict[int, list[float]] = {}
    for t, v in zip(times, values):
        buckets.setdefault(int(t // WINDOW_S), []).append(v)
    xs, ys = [], []
    for b in range(int(end_s // WINDOW_S) + 1):
        if b in buckets:
            ordered = sorted(buckets[b])
            xs.append((b + 0.5) * WINDOW_S)
            ys.append(ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))])
    return xs, ys


def plots(rows: Sequence[dict[str, Any]], records: Sequence[RunRecord], out: Path) -> list[str]:
    pngs = PNGs(out)
    plt, save = pngs.plt, pngs.save

    fig, ax = plt.subplots(figsize=(7, 4))
    for record in records:
        values = sorted(record.ttft_s)
        if values:
            ax.plot(values, [(i + 1) / len(values) for i in range(len(values))], label=record.router)
    ax.set(xlabel="TTFT (s)", ylabel="fraction of requests", title="TTFT CDF", xscale="log")
    ax.legend(fontsize=7)
    save(fig, "ttft_cdf.png")

    fig, ax = plt.subplots(figsize=(7, 4))
    for record in records:
        ax.plot(*_windows(record.arrivals, record.ttft_s, record.end_s, 0.99), label=record.router)
    ax.set(xlabel="arrival (simulated s)", ylabel="TTFT p99 (s)", title=f"TTFT p99 per {WINDOW_S:g} s", yscale="log")
    ax.legend(fontsize=7)
    save(fig, "ttft_over_time.png")

    fig, ax = plt.subplots(figsize=(7, 4))
    for record in records:
        bins = int(record.end_s // 60) + 1
        counts = [0] * bins
        for t in record.load_times_s:
            counts[min(bins - 1, int(t // 60))] += 1
        ax.plot([b + 0.5 for b in range(bins)], counts, label=record.router)
    ax.set(xlabel="simulated minute", ylabel="adapter loads", title="adapter loads per minute")
    ax.legend(fontsize=7)
    save(fig, "adapter_loads.png")

    fig, ax = plt.subplots(figsize=(7, 4))
    for record in records:
        duration_s = max(record.end_s, 1e-9)
        util = sorted(slot_s / duration_s / record.num_seq_slots for slot_s in record.slot_s)
        ax.plot(range(len(util)), util, label=record.router)
    ax.set(xlabel="replica (sorted)", ylabel="KV slots in use", title="replica utilisation spread")
    ax.legend(fontsize=7)
    save(fig, "replica_utilisation.png")

    fig, ax = plt.subplots(figsize=(7, 4))
    tenants = sorted({t for row in rows for t in row["tenants"]})
    width = 0.8 / max(1, len(rows))
    for k, row in enumerate(rows):
        ax.bar([i + k * width for i in range(len(tenants))],
               [row["tenants"].get(t, {}).get("good_admitted_share", math.nan) for t in tenants], width, label=row["router"])
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(tenants))], tenants)
    ax.set(ylabel="met the SLO (of admitted)", title="goodput per tenant", ylim=(0, 1.05))
    ax.legend(fontsize=7)
    save(fig, "goodput_per_tenant.png")
    return pngs.written
