"""bench/sim with workers that have adapter tiers: each replica keeps a few of the adapters it
serves on its device (least recently used evicted) and loads the others on use; the production
router reads each replica's `Residents` (the gateway's model of where a worker has its adapters)
and so sends an adapter's requests where it is loaded: fewer loads than the routers that only
know who serves an adapter, the same requests and placement."""

from __future__ import annotations

from dataclasses import replace

import bench.sim.routers as routers_module
import gateway.policy.routing as routing
from bench.sim.fleet import Fleet, place
from tests.bench.test_sim import PROFILE, scenario


def loads(router: str, device_adapters: int | None) -> tuple[int, dict[str, int]]:
    fleet = scenario(rate_rps=30.0, num_adapters=60, duration_s=60.0)
    profile = replace(PROFILE, adapter_load_s=0.05, device_adapters=device_adapters)
    record = Fleet(fleet, fleet.scenario, profile, place(fleet, 8), router).run()
    return record.num_adapter_loads, record.outcomes


def test_the_router_reads_the_production_residents_model() -> None:
    assert routers_module.Residents is routing.Residents


def test_with_tiers_ours_loads_fewer_adapters_than_routers_that_only_know_who_serves_them() -> None:
    ours, outcomes = loads("ours", 6)  # 6 of the ~20 adapters each replica serves on its device
    p2c, _ = loads("holders-then-p2c", 6)
    least, _ = loads("holders-only-least-loaded", 6)
    assert outcomes["completed"] > 1000
    assert 0 < ours < 0.85 * min(p2c, least), (ours, p2c, least)  # measured: 485 against 684 and 641
    assert loads("ours", None)[0] == 0  # without tiers every adapter a replica serves is on its device


def test_a_host_budget_makes_some_loads_come_from_below_it() -> None:
    """profile.host_adapters: an adapter not in host memory comes up in adapter_load_lower_s, and
    then stays on the host (inclusive of the device); ours also prefers a replica with it on its host."""
    fleet = scenario(rate_rps=30.0, num_adapters=60, duration_s=60.0)
    runs = {}
    for router in ("ours", "holders-then-p2c"):
        profile = replace(PROFILE, adapter_load_s=0.01, adapter_load_lower_s=0.2, device_adapters=4, host_adapters=8)
        fleet_run = Fleet(fleet, fleet.scenario, profile, place(fleet, 8), router)
        record = fleet_run.run()
        runs[router] = record
        assert all(len(r.host) <= 8 and set(r.loaded) <= set(r.host) for r in fleet_run.replicas)
    ours, p2c = runs["ours"], runs["holders-then-p2c"]
    assert 0 < ours.num_lower_loads < ours.num_adapter_loads and 0 < p2c.num_lower_loads
    assert ours.num_lower_loads < p2c.num_lower_loads, (ours.num_lower_loads, p2c.num_lower_loads)
    all_host = Fleet(fleet, fleet.scenario, replace(PROFILE, adapter_load_s=0.01, device_adapters=4), place(fleet, 8), "ours").run()
    assert all_host.num_lower_loads == 0  # no host budget: every adapter a replica serves is in its memory
