"""bench/sim's faults: a replica lost under load (its begun streams fail, its other requests go to
another replica; it comes back empty) and the shared prefix tier (Redis) down for a while; every
request still ends exactly once."""

from __future__ import annotations

from bench.sim.fleet import OUTCOMES, Fleet, place
from bench.sim.routers import ROUTERS
from bench.sim.workload import requests
from tests.bench.test_sim import PROFILE, scenario

LOST = [{"at_s": 12, "kind": "replica_lost", "replicas": 4, "for_s": 8}]


def run(router: str = "ours", **sim: object):
    fleet = scenario(rate_rps=40.0, duration_s=40.0, **sim)
    fleet_run = Fleet(fleet, fleet.scenario, PROFILE, place(fleet, 6), router)
    return fleet_run.run(), sum(1 for _ in requests(fleet.scenario)), fleet_run


def test_every_request_ends_once_when_replicas_are_lost_and_redis_is_down() -> None:
    faults = [*LOST, {"at_s": 20, "kind": "redis_down", "for_s": 10}]
    for router in ROUTERS:
        record, num_requests, _ = run(router, faults=faults)
        assert sum(record.outcomes[o] for o in OUTCOMES) == num_requests, router


def test_a_lost_replica_fails_only_the_streams_it_had_begun() -> None:
    whole, _, fleet_run = run(faults=LOST, stream_share=0.0)
    assert whole.num_lost >= 5 and whole.outcomes["completed"] > 1000
    # a whole request is tried again elsewhere unless it has used its max_attempts (a 503 before, say)
    assert whole.outcomes["failed_replica_lost"] == whole.num_lost - whole.num_lost_retried
    assert whole.num_lost_retried >= 0.6 * whole.num_lost
    assert not fleet_run.down and all(not r.is_down for r in fleet_run.replicas)  # back after for_s
    streamed, _, _ = run(faults=LOST, stream_share=1.0)
    assert streamed.outcomes["failed_replica_lost"] > whole.outcomes["failed_replica_lost"]  # begun streams end with it
    quiet, _, _ = run(stream_share=1.0)
    assert quiet.num_lost == quiet.outcomes["failed_replica_lost"] == 0


def test_redis_down_costs_prefix_hits_while_it_lasts() -> None:
    up, _, _ = run()
    down, _, _ = run(faults=[{"at_s": 5, "kind": "redis_down", "for_s": 30}])
    assert down.cached_tokens < 0.5 * up.cached_tokens
