"""`loraplex simulate --autoscale`: the same requests on shards whose replicas follow demand, one
run per scaling policy (bench/sim/autoscalers.py), beside the fewest fixed replicas that meet the
SLO; per run, the replica-seconds used and the share of admitted requests within the SLO.

Scaled runs place the adapters on the scenario's `sim.autoscaling.shards` shards (placement's
plan for that many replicas: every adapter on `redundancy` of them), each starting with
`sim.autoscaling.initial_replicas` (at least the policy's min) and scaled within min and max. The fixed
runs place them on N replicas as today (hot adapters on more of them); the smallest such N whose
share within the SLO is GOOD_SHARE is found by binary search.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

from bench.sim.autoscalers import Policy
from bench.sim.fleet import Fleet, Placement, place
from bench.sim.profile import CostProfile
from bench.sim.report import SLO, figures
from bench.sim.scaling import Scaler
from bench.sim.workload import FleetScenario
from gateway.policy.routing import RoutingSettings

GOOD_SHARE = 0.99  # of the admitted requests, within the SLO


def fewest_shards(fleet: FleetScenario) -> int:
    """The fewest replicas that hold every adapter `redundancy` times (placement's capacity per replica)."""
    sim = fleet.sim
    return max(1, math.ceil(len(fleet.scenario.adapters.names) * sim.redundancy / sim.max_adapters_per_replica))


def scaled_placement(fleet: FleetScenario) -> tuple[Placement, dict[str, list[int]], dict[str, int]]:
    """Every replica each shard may have (max_replicas, the shard's pins), each shard's replicas by
    index, and how many of them serve from the start."""
    scaling = fleet.sim.autoscaling
    base = place(fleet, scaling.shards or fewest_shards(fleet))
    most = scaling.policy.max_replicas
    pins: list[frozenset[str]] = []
    names: list[str] = []
    shards: dict[str, list[int]] = {}
    initial: dict[str, int] = {}
    for held, name in zip(base.pins, base.shards):
        if name in shards:
            initial[name] += 1
            continue
        shards[name] = list(range(len(pins), len(pins) + most))
        initial[name] = 1
        pins += [held] * most
        names += [name] * most
    holders: dict[str, list[int]] = {}
    for i, held in enumerate(pins):
        for adapter in held:
            holders.setdefault(adapter, []).append(i)
    low = max(scaling.policy.min_replicas, scaling.initial_replicas)
    return Placement(tuple(pins), holders, tuple(names)), shards, {n: min(max(k, low), most) for n, k in initial.items()}


def _row(name: str, record_figures: dict[str, Any], replica_s: float, peak: int, measured_s: float) -> dict[str, Any]:
    return {"policy": name, "replica_s": replica_s, "mean_replicas": replica_s / measured_s, "peak_replicas": peak,
            "good_admitted_share": record_figures["good_admitted_share"], "ttft_p50_s": record_figures["ttft_p50_s"],
            "ttft_p99_s": record_figures["ttft_p99_s"], "refused_busy": record_figures["refused_busy"],
            "failed": record_figures["failed"], "tenants": record_figures["tenants"]}


def run_scaled(fleet: FleetScenario, policy: str | Policy, profile: CostProfile, slo: SLO,
               routing: RoutingSettings = RoutingSettings(), name: str | None = None) -> tuple[dict[str, Any], Scaler]:
    """One run with every shard scaled by `policy` (a name in SCALERS, or what builds a shard's policy; `name`:
    its row's, the policy's name by default): its row, and the Scaler (its timeline)."""
    scenario, scaling = fleet.scenario, fleet.sim.autoscaling
    placement, shards, initial = scaled_placement(fleet)

    def build(run: Fleet) -> Scaler:
        return Scaler(run, shards, scaling.policy, policy, initial, scaling.tick_s)

    run = Fleet(fleet, scenario, profile, placement, "ours", routing, scaling=build)
    record = run.run()
    measured_s = scenario.duration_s - scenario.warmup_s
    assert run.scaler is not None
    done = run.scaler.figures
    row_name = name or (policy if isinstance(policy, str) else "custom")
    return _row(row_name, figures(record, slo, measured_s), done.replica_s, done.peak, measured_s), run.scaler


def run_fixed(fleet: FleetScenario, num_replicas: int, profile: CostProfile, slo: SLO,
              routing: RoutingSettings = RoutingSettings()) -> dict[str, Any]:
    """Today's fleet: `num_replicas` replicas placed by plan, never changed."""
    scenario = fleet.scenario
    record = Fleet(fleet, scenario, profile, place(fleet, num_replicas), "ours", routing).run()
    measured_s = scenario.duration_s - scenario.warmup_s
    return _row(f"fixed {num_replicas}", figures(record, slo, measured_s), num_replicas * measured_s, num_replicas, measured_s)


def smallest_fixed(fleet: FleetScenario, most: int, profile: CostProfile, slo: SLO,
                   routing: RoutingSettings = RoutingSettings()) -> dict[str, Any] | None:
    """The row of the fewest fixed replicas (up to `most`) meeting GOOD_SHARE; None if `most` does not."""
    rows: dict[int, dict[str, Any]] = {}

    def meets(n: int) -> bool:
        rows[n] = run_fixed(fleet, n, profile, slo, routing)
        return rows[n]["good_admitted_share"] >= GOOD_SHARE

    high = fewest(meets, fewest_shards(fleet), most)
    if high is None:
        return None
    return rows[high] if high in rows else run_fixed(fleet, high, profile, slo, routing)


def fewest(meets: Callable[[int], bool], low: int, high: int) -> int | None:
    """The fewest n in [low, high] that `meets` (monotone in n: a binary search); None if `high` does not."""
    if not meets(high):
        return None
    while low < high:
        middle = (low + high) // 2
        if meets(middle):
            high = middle
        else:
            low = middle + 1
    return high


def compare(fleet: FleetScenario, policies: Sequence[str], profile: CostProfile, slo: SLO, most_fixed: int,
            routing: RoutingSettings = RoutingSettings()) -> list[dict[str, Any]]:
    """Every policy's row, then the smallest fixed fleet's (if one up to `most_fixed` meets the SLO);
    each row's `vs_fixed`: its replica-seconds over that fleet's."""
    rows = [run_scaled(fleet, p, profile, slo, routing)[0] for p in policies]
    best = smallest_fixed(fleet, most_fixed, profile, slo, routing)
    if best is not None:
        best = {**best, "policy": f"{best['policy']} (fewest fixed meeting the SLO)"}
        rows.append(best)
    for row in rows:
        row["vs_fixed"] = row["replica_s"] / best["replica_s"] if best is not None else math.nan
    return rows


def scaling_table(rows: Sequence[dict[str, Any]]) -> str:
    lines = ["policy                                          replica-s  mean  peak  vs fixed  good (admitted)  TTFT p50  TTFT p99   503"]
    for r in rows:
        lines.append(f"{r['policy']:46} {r['replica_s']:10.0f} {r['mean_replicas']:5.1f} {r['peak_replicas']:5} {r['vs_fixed']:9.1%}"
                     f" {r['good_admitted_share']:16.2%} {r['ttft_p50_s']:9.3f} {r['ttft_p99_s']:9.3f} {r['refused_busy']:5}")
    return "\n".join(lines)
