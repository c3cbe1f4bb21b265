"""`loraplex simulate`: the fleet of a scenario in virtual time, once per router, and a table
(or JSON) of what each achieved; `--capacity`: the fewest replicas meeting the SLO per router."""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from bench.sim.autoscalers import SCALERS
from bench.sim.elastic import compare, fewest, fewest_shards, scaling_table
from bench.sim.fleet import Fleet, place
from bench.sim.plots import write_report
from bench.sim.profile import DEFAULT_PROFILE, CostProfile, load_profile
from bench.sim.record import RunRecord
from bench.sim.report import SLO, figures, table, tenant_table
from bench.sim.routers import ROUTERS
from bench.sim.workload import FleetScenario, load_fleet_scenario, scaled
from gateway.config import ConfigError
from gateway.loadtest.scenario import Scenario
from gateway.policy.routing import RoutingSettings

GOOD_SHARE = 0.99  # --capacity: the share of requests the rate limits admit that must meet the SLO


def simulate(fleet: FleetScenario, num_replicas: int, routers: list[str], profile_name: str | None = None,
             slo: SLO | None = None, shared_cache: bool | None = None, device_adapters: int | None = None,
             profile_changes: dict[str, Any] | None = None, records: list[RunRecord] | None = None,
             routing: RoutingSettings = RoutingSettings()) -> list[dict[str, Any]]:
    """One run per router over the same requests and placement; their figures. `device_adapters`:
    workers with adapter tiers, that many on each device (the profile's otherwise); `profile_changes`:
    other fields of the profile to set; `records`: each run's record appended there; `routing`: the
    gateway's routing settings (ours reads its bound, eps; every router, max_attempts)."""
    profile = load_profile(profile_name or fleet.sim.profile or DEFAULT_PROFILE)
    changes = {**(profile_changes or {}), **({"device_adapters": device_adapters} if device_adapters is not None else {})}
    if changes:
        profile = replace(profile, **changes)
    scenario = fleet.scenario
    slo = slo or SLO(scenario.slo.ttft_s, fleet.sim.itl_s)
    placement = place(fleet, num_replicas)
    measured_s = scenario.duration_s - scenario.warmup_s
    rows = []
    for router in routers:
        record = Fleet(fleet, scenario, profile, placement, router, routing, shared_cache=shared_cache).run()
        rows.append(figures(record, slo, measured_s))
        if records is not None:
            records.append(record)
    return rows


def capacity(fleet: FleetScenario, max_replicas: int, router: str, **kwargs) -> int | None:
    """The fewest replicas (binary search up to `max_replicas`) whose goodput share is GOOD_SHARE."""
    def meets(n: int) -> bool:
        return simulate(fleet, n, [router], **kwargs)[0]["good_admitted_share"] >= GOOD_SHARE

    return fewest(meets, fewest_shards(fleet), max_replicas)


def describe(scenario: Scenario, profile: CostProfile, slo: SLO) -> str:
    """The line that says what was simulated."""
    load = f"{scenario.load.rate_rps:g} req/s" if scenario.load.mode == "open" else "closed-loop users (sim.users)"
    return (f"{scenario.name}: {len(scenario.adapters.names)} adapters, {load}, "
            f"{scenario.duration_s:g} s (warm-up {scenario.warmup_s:g} s), profile {profile.name} "
            f"({'measured' if profile.is_measured else 'ASSUMED'}), SLO TTFT {slo.ttft_s:g} s ITL {slo.itl_s:g} s")


def print_capacity(args: argparse.Namespace, what: str, result: dict[str, int | None], wall_s: float) -> None:
    if args.json:
        print(json.dumps({"capacity": result, "good_share": GOOD_SHARE, "wall_s": wall_s}))
        return
    print(what)
    for router, n in result.items():
        print(f"{router:28} {n if n is not None else f'> {args.replicas}'} replicas")


def print_rows(args: argparse.Namespace, what: str, scenario: Scenario, profile: CostProfile, rows: list[dict[str, Any]],
               records: list[RunRecord], wall_s: float) -> None:
    if args.out:
        written = write_report(Path(args.out), f"{what}; {args.replicas} replicas", rows, records)
        print(f"loraplex simulate: report in {args.out}/ ({', '.join(written)})", file=sys.stderr)
    if args.json:
        print(json.dumps({"scenario": scenario.name, "replicas": args.replicas, "profile": profile.name,
                          "is_measured": profile.is_measured, "rows": rows, "wall_s": wall_s}))
    else:
        print(f"{what}; {args.replicas} replicas")
        print(table(rows))
        print(tenant_table(rows))
        print(f"({wall_s:.1f} s of wall time)")


def run_autoscale(args: argparse.Namespace, fleet: FleetScenario) -> int:
    """--autoscale P,Q: one run per scaling policy, and the fewest fixed replicas (up to --replicas) meeting the SLO."""
    policies = [p for p in args.autoscale.split(",") if p]
    unknown = [p for p in policies if p not in SCALERS]
    if unknown:
        print(f"loraplex simulate: unknown scaling policy {unknown[0]!r} (known: {', '.join(SCALERS)})", file=sys.stderr)
        return 2
    profile = load_profile(args.profile or fleet.sim.profile or DEFAULT_PROFILE)
    slo = SLO(args.ttft_slo_s or fleet.scenario.slo.ttft_s, args.itl_slo_s or fleet.sim.itl_s)
    started = time.perf_counter()  # only to report how long the simulation took
    try:
        rows = compare(fleet, policies, profile, slo, args.replicas)
    except ValueError as e:
        print(f"loraplex simulate: {e}", file=sys.stderr)
        return 2
    wall_s = time.perf_counter() - started
    if args.json:
        print(json.dumps({"scenario": fleet.scenario.name, "profile": profile.name, "rows": rows, "wall_s": wall_s}))
        return 0
    print(f"{describe(fleet.scenario, profile, slo)}; scaled: {fleet.sim.autoscaling.shards or fewest_shards(fleet)} shards, "
          f"{fleet.sim.autoscaling.policy}")
    print(scaling_table(rows))
    print(f"({wall_s:.1f} s of wall time)")
    return 0


def run(args: argparse.Namespace) -> int:
    try:
        fleet = load_fleet_scenario(args.scenario)
    except ConfigError as e:
        print(f"loraplex simulate: {e}", file=sys.stderr)
        return 2
    if args.rate_rps is not None and fleet.scenario.load.mode != "open":
        print(f"loraplex simulate: --rate-rps sets an open loop's rate, and {args.scenario}'s load is closed-loop: its users "
              "(sim.users) set the rate; change their number or think time in the scenario instead", file=sys.stderr)
        return 2
    scenario = scaled(fleet.scenario, args.rate_rps, args.duration_s, args.seed)
    if args.max_requests is not None:
        scenario = scenario.model_copy(update={"max_requests": args.max_requests})
    fleet = FleetScenario(scenario, fleet.sim)
    if scenario.duration_s <= scenario.warmup_s:
        print(f"loraplex simulate: the duration ({scenario.duration_s:g} s) must be longer than the scenario's warm-up "
              f"({scenario.warmup_s:g} s): only requests after the warm-up are measured", file=sys.stderr)
        return 2
    if args.autoscale:
        return run_autoscale(args, fleet)
    routers = args.policy or list(ROUTERS)
    unknown = [r for r in routers if r not in ROUTERS]
    if unknown:
        print(f"loraplex simulate: unknown policy {unknown[0]!r} (known: {', '.join(ROUTERS)})", file=sys.stderr)
        return 2
    slo = SLO(args.ttft_slo_s or scenario.slo.ttft_s, args.itl_slo_s or fleet.sim.itl_s)
    shared = False if args.no_shared_cache else None
    changes = {k: v for k, v in (("l2_fetch_token_s", args.l2_fetch_token_s), ("l2_lookup_s", args.l2_lookup_s),
                                 ("host_adapters", args.host_adapters)) if v is not None}
    records: list[RunRecord] = []
    try:
        routing = RoutingSettings(eps=args.eps) if args.eps is not None else RoutingSettings()
    except ValueError as e:
        print(f"loraplex simulate: --eps: {e}", file=sys.stderr)
        return 2
    started = time.perf_counter()  # only to report how long the simulation took; no decision reads it
    try:
        if args.capacity:
            result = {r: capacity(fleet, args.replicas, r, profile_name=args.profile, slo=slo, shared_cache=shared,
                                  device_adapters=args.device_adapters, profile_changes=changes, routing=routing)
                      for r in routers}
        else:
            rows = simulate(fleet, args.replicas, routers, args.profile, slo, shared, args.device_adapters, changes,
                            records if args.out else None, routing)
    except ValueError as e:
        print(f"loraplex simulate: {e}", file=sys.stderr)
        return 2
    wall_s = time.perf_counter() - started
    profile = load_profile(args.profile or fleet.sim.profile or DEFAULT_PROFILE)
    if args.capacity:
        print_capacity(args, describe(scenario, profile, slo), result, wall_s)
    else:
        print_rows(args, describe(scenario, profile, slo), scenario, profile, rows, records, wall_s)
    return 0
