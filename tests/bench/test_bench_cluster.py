"""bench-cluster's arithmetic over request outcomes (the run itself: `loraplex bench-cluster`, as root;
its topology is the multi-node test's, tests/cluster)."""

from __future__ import annotations

import math

from bench.cluster.bench import PREFIX_TOKENS, Outcome, cross_node_hits, node_loss, summary
from gateway.cli import build_parser


def outcome(started: float, ended: float, ok: bool = True, replica: str = "s-0", prefix: int = 0, cached: int = 0,
            ttft_s: float | None = 0.1, streamed: bool = True) -> Outcome:
    return Outcome(started, ended, ok, streamed, ttft_s, replica, prefix, cached)


def test_the_summary_counts_only_answers_in_its_rate_and_ttft() -> None:
    outcomes = [outcome(0, 1, ttft_s=0.1 * i) for i in range(1, 11)] + [outcome(0, 1, ok=False, ttft_s=9.0)]
    s = summary(outcomes, duration_s=5.0)
    assert (s["requests"], s["failed"], s["req_per_s"]) == (11, 1, 2.0)
    assert math.isclose(s["ttft_p50_ms"], 600) and math.isclose(s["ttft_p99_ms"], 1000)  # the failed one's 9 s is left out


def test_a_cross_node_hit_is_a_request_on_another_replica_after_its_prefix_was_first_answered() -> None:
    outcomes = [
        outcome(0, 1, replica="s-0", prefix=0),  # prefix 0's first answer: its home is s-0
        outcome(0.5, 2, replica="s-1", prefix=0, cached=0),  # started before that answer: not counted
        outcome(1.5, 3, replica="s-1", prefix=0, cached=PREFIX_TOKENS),  # away, found it all
        outcome(1.5, 3, replica="s-1", prefix=0, cached=32),  # away, found a part
        outcome(2, 3, replica="s-0", prefix=0, cached=PREFIX_TOKENS),  # at home: not counted
        outcome(4, 5, replica="s-1", prefix=1, ok=False),  # failed: never a home
    ]
    found = cross_node_hits(outcomes)
    assert (found["requests"], found["hits"], found["hit_rate"], found["mean_cached_tokens"]) == (2, 1, 0.5, 64)


def test_a_node_loss_counts_what_was_in_flight_or_sent_after_and_the_longest_wait() -> None:
    outcomes = [
        outcome(0, 2), outcome(1, 3),  # before the kill at 10
        outcome(9, 11, ok=False, streamed=True),  # in flight on the dead node: a stream ended with the error
        outcome(9, 14),  # in flight, retried elsewhere: answered 4 s after the kill
        outcome(10.5, 15, ok=False, streamed=False), outcome(12, 16),
    ]
    loss = node_loss(outcomes, killed_at=10, before_s=10, after_s=10)
    assert (loss["requests_after"], loss["failed_whole"], loss["failed_streams"]) == (4, 1, 1)
    assert loss["longest_wait_s"] == 4 and loss["slowest_request_s"] == 5
    assert (loss["req_per_s_before"], loss["req_per_s_after"]) == (0.2, 0.2)


def test_the_command_takes_its_flags() -> None:
    args = build_parser().parse_args(["bench-cluster", "--duration", "5", "--concurrency", "2", "--loss-window", "12"])
    assert (args.duration, args.concurrency, args.loss_window, args.handler) == (5.0, 2, 12.0, "bench.cluster.bench:run")
