"""bench/autoscale_burst.py's arithmetic over the gateway's readings and the requests' outcomes
(bench/autoscale_readings.py; the run itself: `python -m bench.autoscale_burst`, as root, on the
multi-node topology of tests/cluster)."""

from __future__ import annotations

from bench.autoscale_burst import parse
from bench.autoscale_readings import Request, Sample, at_min, failed_between, first_leaving, scale_up, timeline

U, S, D, A = "up", "starting", "draining", "asleep"


def sample(at_s: float, *phases: str, routed: tuple[float, ...] = (0.0, 0.0, 0.0)) -> Sample:
    return Sample(at_s, phases, routed)


READINGS = [
    sample(0.0, U, A, A, routed=(5, 0, 0)),
    sample(10.0, U, A, A, routed=(9, 0, 0)),  # the burst starts at 10
    sample(14.0, U, S, S, routed=(20, 0, 0)),
    sample(30.0, U, U, S, routed=(40, 0, 0)),  # s-1 up, not routed to yet
    sample(31.0, U, U, S, routed=(41, 3, 0)),
    sample(33.0, U, U, U, routed=(42, 6, 2)),
    sample(60.0, U, U, A, routed=(50, 9, 4)),  # s-2 drained between two readings
    sample(70.0, U, D, A, routed=(51, 9, 4)),
    sample(71.0, U, A, A, routed=(52, 9, 4)),
]


def test_a_new_replica_is_timed_from_the_burst_start_to_starting_up_routed_and_answered() -> None:
    answers = [Request(28.0, 29.5, True, True, "s-1", ttft_s=0.5), Request(30.0, 31.0, False, True, "s-1"),
               Request(5.0, 6.0, True, True, "s-2")]  # before the burst: not its answer
    up = scale_up(READINGS, answers, "s-1", 1, burst_s=10.0)
    assert up == {"starting": 4.0, "up": 20.0, "routed": 21.0, "answered": 18.5}
    assert scale_up(READINGS, answers, "s-2", 2, burst_s=10.0)["answered"] is None


def test_a_replica_leaves_when_seen_draining_or_asleep_after_up() -> None:
    assert first_leaving(READINGS, 10.0) == 60.0
    assert first_leaving(READINGS, 61.0) == 70.0
    assert [at_min(s.phases, 1) for s in READINGS[-3:]] == [False, False, True]


def test_only_failed_requests_in_flight_in_the_window_count() -> None:
    requests = [Request(50, 61, False, True, "s-2"), Request(65, 80, False, False, "s-0"), Request(55, 65, True, True, "s-1"),
                Request(40, 59, False, True, "s-0"), Request(72, 73, False, True, "s-0")]
    assert failed_between(requests, 60.0, 71.0) == requests[:2]


def test_the_timeline_shows_each_change_from_the_origin() -> None:
    assert timeline(READINGS[:4], origin_s=10.0) == "-10.0 s UAA | +4.0 s USS | +20.0 s UUS"


def test_the_defaults_aim_at_three_replicas_from_one() -> None:
    args = parse([])
    assert (args.min_replicas, args.max_replicas, args.model) == (1, 3, "tiny")
    assert args.burst_users > 3 * args.target * args.slots  # the burst asks for more than two replicas' target
