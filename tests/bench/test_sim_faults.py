"""bench/sim's faults: a replica lost under load (its begun streams fail, its other requests go to
another replica; it comes back empty) and the shared prefix tier (Redis) down for a while; every
request still ends exactly once."""

from __future__ import annotations

import pytest

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


def test_a_shared_tier_with_costs_keeps_an_l1_beside_it_and_redis_slow_delays_first_tokens() -> None:
    """With the tier's costs in the profile, each replica has its own L1: a chunk it holds costs
    nothing, one fetched from the tier costs a round trip and its tokens; Redis slow adds to each lookup."""
    from dataclasses import replace

    from bench.sim.report import SLO, figures

    def ttft_p50(record, start_s: float, end_s: float) -> float:
        values = sorted(t for t, seq_at in zip(record.ttft_s, record.arrivals) if start_s <= seq_at < end_s)
        return values[len(values) // 2]

    fleet = scenario(rate_rps=40.0, duration_s=40.0)
    free = Fleet(fleet, fleet.scenario, PROFILE, place(fleet, 6), "ours").run()
    costly = replace(PROFILE, l2_fetch_token_s=0.0005, l2_lookup_s=0.002)
    paid = Fleet(fleet, fleet.scenario, costly, place(fleet, 6), "ours").run()
    assert 0 < paid.fetched_tokens < paid.cached_tokens  # some chunks came from a replica's own L1
    assert paid.cached_tokens == pytest.approx(free.cached_tokens, rel=0.1)
    slo = SLO(1.0, 0.1)
    assert figures(paid, slo, 38)["ttft_p50_s"] > figures(free, slo, 38)["ttft_p50_s"]
    slow_fleet = scenario(rate_rps=40.0, duration_s=40.0, faults=[{"at_s": 20, "kind": "redis_slow", "for_s": 10,
                                                                   "latency_s": 0.3}])
    slow = Fleet(slow_fleet, slow_fleet.scenario, costly, place(slow_fleet, 6), "ours").run()
    assert sum(slow.outcomes.values()) == sum(paid.outcomes.values())
    assert ttft_p50(slow, 20, 30) >= ttft_p50(paid, 20, 30) + 0.25  # every lookup waits 0.3 s more
    assert ttft_p50(slow, 32, 40) == pytest.approx(ttft_p50(paid, 32, 40), abs=0.05)  # and no more once it is over
    with pytest.raises(ValueError, match="redis_slow fault needs"):
        Fleet(slow_fleet, slow_fleet.scenario, PROFILE, place(slow_fleet, 6), "ours")
