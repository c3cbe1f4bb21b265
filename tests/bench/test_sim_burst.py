"""The simulator's closed-loop users (bench/sim/users.py), a scaled replica's events (bench/sim/scaling.py),
and bench/autoscale_burst.py's run in the simulator beside the real one (bench/sim/burst.py,
bench/autoscale_readings.py)."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from bench.sim.burst import SCENARIO, BurstFigures, BurstShape, beside, mirrored, replica_seconds, side_by_side, simulated
from bench.autoscale_readings import Request, Sample, real_figures
from bench.sim.fleet import Fleet, place
from bench.sim.profile import load_profile
from bench.sim.users import REFUSED_PAUSE_S, ClosedLoop
from bench.sim.workload import SimRequest, load_fleet_scenario, parse_fleet_scenario
from gateway.config import ConfigError
from gateway.policy.autoscale import AutoscalingSettings


def closed(groups: list[dict] | None = None, **load: object) -> dict:
    return {"name": "closed", "duration_s": 30, "max_requests": 100, "load": {"mode": "closed", **load},
            "tenants": [{"name": "t"}], "adapters": {"names": ["base"], "weights": {"base": 1}},
            "prompts": {"kind": "random", "length": {"min": 8, "max": 8}}, "output_tokens": {"min": 4, "max": 4},
            "sim": {"users": groups or []}}


def test_a_closed_scenario_without_users_runs_the_load_testers_users_throughout() -> None:
    fleet = parse_fleet_scenario(closed(users=4))
    assert [(u.num_users, u.from_s, u.until_s) for u in fleet.sim.users] == [(4, 0.0, None)]
    with pytest.raises(ConfigError, match="sim.users names unknown tenants: nobody"):
        parse_fleet_scenario(closed([{"tenant": "nobody"}]))


def test_a_user_sends_its_next_request_once_its_last_has_ended_and_paused() -> None:
    fleet = parse_fleet_scenario(closed([{"num_users": 2, "from_s": 5, "until_s": 20, "think_s": 1.0,
                                          "output_tokens": {"min": 7, "max": 7}}]))
    sent: list[SimRequest] = []
    users = ClosedLoop(fleet, fleet.scenario, sent.append, hop_s=0.25)
    assert [(r.at_s, r.max_tokens, r.index) for r in sent] == [(5.0, 7, 100), (5.0, 7, 101)]  # above max_requests
    users.ended(sent[0], "completed", 8.0)
    assert (sent[-1].at_s, sent[-1].index) == (9.25, 102)  # the hop, then its pause
    users.ended(sent[1], "refused_busy", 8.0)
    assert sent[-1].at_s == 8.0 + 0.25 + max(1.0, REFUSED_PAUSE_S)
    users.ended(sent[-1], "completed", 19.0)  # its next would come after until_s: none
    assert len(sent) == 4 and users.last_end_s == [19.0]
    users.ended(SimRequest(7, 0.0, "t", "base", -1, 0, 8, 4), "completed", 19.5)  # not a user's: nothing sent
    assert len(sent) == 4


def test_a_closed_loop_fleet_keeps_its_users_requests_in_flight_and_ends_every_one() -> None:
    fleet = parse_fleet_scenario(closed(users=3))
    profile = load_profile("tiny-2core")
    run = Fleet(fleet, fleet.scenario, profile, place(fleet, 1), "ours")
    record = run.run()
    assert record.outcomes["completed"] == sum(run.users.num_sent) > 3 * 30 / 0.1  # back to back, ~10 ms a request
    assert max(record.arrivals) < fleet.scenario.duration_s


def test_the_burst_scenario_scales_up_after_the_replicas_start_and_back_after_the_burst() -> None:
    fleet = load_fleet_scenario(SCENARIO)
    profile = load_profile("tiny-2core")
    figures = simulated(fleet, profile)
    assert figures.peak == 3 and figures.num_failed == 0
    for asked_s, answered_s in zip(figures.starting_s, figures.answered_s):
        assert asked_s is not None and answered_s is not None
        assert asked_s <= 2.0 and answered_s >= asked_s + profile.replica_start_s
    assert figures.back_s is not None and 0 < figures.back_s < 60
    fast = simulated(fleet, replace(profile, replica_start_s=1.0))
    assert fast.answered_s[0] < figures.answered_s[0] - 10


def test_the_burst_scenario_takes_the_real_runs_flags() -> None:
    fleet = load_fleet_scenario(SCENARIO)
    settings = AutoscalingSettings(min_replicas=1, max_replicas=2, target_utilization=0.8)
    changed = mirrored(fleet, settings, BurstShape(burst_users=8, burst_s=20, burst_tokens=5, light_gap_s=2, light_before_s=10))
    light, burst = changed.sim.users
    assert (burst.num_users, burst.from_s, burst.until_s, burst.output_tokens.max) == (8, 10, 30, 5)
    assert light.think_s == 2 and changed.sim.autoscaling.policy == settings
    assert changed.scenario.duration_s == 30 + fleet.scenario.duration_s - fleet.sim.users[1].until_s  # as long after


def test_replica_seconds_hold_each_reading_until_the_next() -> None:
    timeline = [(0.0, 1), (10.0, 3), (20.0, 2), (30.0, 1)]
    assert replica_seconds(timeline, 5.0, 25.0) == 5 * 1 + 10 * 3 + 5 * 2
    assert replica_seconds(timeline, 25.0, 40.0) == 5 * 2 + 10 * 1


def test_the_real_runs_figures_read_its_samples_as_the_simulated_ones() -> None:
    samples = [Sample(0.0, ("up", "asleep"), (0, 0)), Sample(10.0, ("up", "starting"), (0, 0)),
               Sample(20.0, ("up", "up"), (0, 1)), Sample(50.0, ("up", "draining"), (0, 1)), Sample(55.0, ("up", "asleep"), (0, 1))]
    requests = [Request(1.0, 2.0, True, True, "s-0"), Request(21.0, 22.0, False, False, "s-1")]
    ups = [{"starting": 5.0, "up": 15.0, "routed": 15.0, "answered": 16.0}]
    figures = real_figures(samples, requests, ups, (5.0, 45.0, 55.0), 2, 0.5)
    assert figures == BurstFigures((5.0,), (16.0,), 10.0, 2, 2, 1, 5 * 1 + 10 * 2 + 30 * 2 + 5 * 2, 0.5)


def test_the_table_puts_real_and_simulated_side_by_side() -> None:
    real = BurstFigures((3.3,), (15.1,), 12.5, 3, 808, 0, 250.0, 0.501)
    sim = BurstFigures((1.0,), (None,), None, 3, 8488, 0, 158.0, math.nan)
    lines = side_by_side(real, sim, ["s-1"]).splitlines()
    assert lines[0].split() == ["real", "simulated"]
    assert lines[2].split()[-2:] == ["15.1", "never"] and lines[3].split()[-2:] == ["12.5", "never"]
    assert lines[7].split()[-2:] == ["250", "158"]


def test_the_bench_prints_its_run_beside_the_same_run_simulated_with_its_flags() -> None:
    real = BurstFigures((3.3,), (13.1,), 11.2, 2, 809, 0, 145.0, 0.511)
    settings = AutoscalingSettings(min_replicas=1, max_replicas=2, target_utilization=0.5, upscale_delay_s=1,
                                   downscale_delay_s=10, lead_s=0)
    text = beside(real, "tiny-2core", settings, 4, BurstShape(16, 20, 8, 1.0, 5), "s")
    assert "profile tiny-2core, replica_start_s 12.4 s" in text
    rows = {line[:50].strip(): line[50:].split() for line in text.splitlines()[2:]}
    assert set(rows) >= {"s-1 asked for (s from the burst's start)", "replicas up at most"}
    assert rows["replicas up at most"] == ["2", "2"] and "s-2 asked for (s from the burst's start)" not in rows


def test_a_closed_loop_scenario_refuses_a_rate_its_users_set(capsys: pytest.CaptureFixture[str]) -> None:
    from gateway.cli import main as cli_main

    assert cli_main(["simulate", "--scenario", str(SCENARIO), "--rate-rps", "5"]) == 2
    err = capsys.readouterr().err
    assert "closed-loop: its users (sim.users) set the rate" in err and "Traceback" not in err
