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
