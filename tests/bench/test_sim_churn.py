"""bench/sim's churn: adapters placed while the fleet runs by the registry's own functions
(rebalance for its re-plan, place_new for a new version), and every request still ends once."""

from __future__ import annotations

import bench.sim.churn as churn_module
import gateway.policy.replan as replan_module
from bench.sim.fleet import OUTCOMES, Fleet, place
from bench.sim.routers import ROUTERS
from bench.sim.workload import requests
from tests.bench.test_sim import PROFILE, scenario


def run(router: str = "ours", num_replicas: int = 20, **churn: object):
    # 40 adapters, 6 a replica: placement leaves room; the ranking shifts by 3 at 15 s (a03 becomes the hottest)
    fleet = scenario(rate_rps=40.0, duration_s=60.0, max_adapters_per_replica=6, churn=churn)
    placement = place(fleet, num_replicas)
    fleet_run = Fleet(fleet, fleet.scenario, PROFILE, placement, router)
    return fleet_run.run(), sum(1 for _ in requests(fleet.scenario)), placement, fleet_run


def test_the_registry_placement_functions_are_the_production_ones() -> None:
    assert churn_module.rebalance is replan_module.rebalance
    assert churn_module.place_new is replan_module.place_new


def test_replans_follow_the_traffic() -> None:
    record, num_requests, placement, fleet_run = run(replan_interval_s=5.0)
    assert record.num_replans == 11 and record.num_pins_moved > 10
    before = {name: len(held) for name, held in placement.holders.items()}
    after = {name: len(held) for name, held in fleet_run.holders.items()}
    assert after["a01"] < before["a01"] and after["a02"] < before["a02"]  # hot before the shift, cold after: copies go
    assert after["a03"] > before["a03"] and after["a03"] > after["a01"]  # the hottest after the shift gains
    assert min(after.values()) >= 2  # never below the redundancy
    # the router follows the moved pins: an adapter only ever runs where it is pinned (no load on a replica without it)
    assert record.num_adapter_loads == 0 and record.outcomes["failed_no_replica"] == 0
    assert sum(record.outcomes[o] for o in OUTCOMES) == num_requests
    for name, held in fleet_run.holders.items():
        assert all(name in fleet_run.replicas[i].pinned for i in held)


def test_new_versions_replace_adapters_while_requests_run() -> None:
    """A new version goes where the old one was (the registry's _place), is served once loaded,
    and the old one is unregistered."""
    record, num_requests, placement, fleet_run = run(new_versions_per_min=30.0)
    assert record.num_new_versions >= 15 and fleet_run.churn.version_of
    for base, current in fleet_run.churn.version_of.items():
        assert base not in fleet_run.holders  # the old version unregistered: pinned nowhere
        assert fleet_run.holders[current] == placement.holders[base]  # on the replicas the first version was on
    assert record.num_adapter_loads == 0 and record.outcomes["failed_no_replica"] == 0
    assert sum(record.outcomes[o] for o in OUTCOMES) == num_requests


def test_every_request_ends_once_under_churn_for_every_router() -> None:
    for router in ROUTERS:
        record, num_requests, _, _ = run(router, replan_interval_s=5.0, new_versions_per_min=20.0, max_adapters_per_replica=8)
        assert sum(record.outcomes[o] for o in OUTCOMES) == num_requests, router


def test_placed_as_the_registry_places_popularity_is_unknown() -> None:
    planned = place(scenario(max_adapters_per_replica=6), 20)
    registered = place(scenario(max_adapters_per_replica=6, placed_by="registry"), 20)
    copies = lambda placement: [len(placement.holders[f"a{i:02d}"]) for i in range(40)]  # noqa: E731
    assert copies(planned)[0] > 3 * copies(planned)[-1]  # the plan copies the popular ones
    assert max(copies(registered)) - min(copies(registered)) <= 1  # without popularity: evenly
