"""The scaling decision (gateway/policy/autoscale.py): bounds, up fast, down to what a longer average of the
demand fits, at most half at once, to zero only after idle, never down while a replica starts; on a fake clock."""

from __future__ import annotations

from dataclasses import replace

import pytest

from gateway.policy.autoscale import AutoscalingSettings, ScalingState, ShardLoad, decide

SLOTS = 64
SETTINGS = AutoscalingSettings(min_replicas=1, max_replicas=8, target_utilization=0.8, ttft_slo_s=1.0, upscale_delay_s=2.0,
                               downscale_delay_s=60.0, downscale_margin=0.15, idle_s=300.0, lead_s=0.0)


def load(ready: int, requests: int, starting: int = 0, ttft_p90_s: float | None = None, backlog_s: float = 0.0,
         queued: int = 0) -> ShardLoad:
    """`requests` spread as the replicas would hold them: slots first, the rest waiting."""
    running = min(requests, ready * SLOTS)
    return ShardLoad(num_ready=ready, num_starting=starting, num_slots=ready * SLOTS, num_running=running,
                     num_waiting=requests - running, backlog_s=backlog_s, ttft_p90_s=ttft_p90_s, num_queued=queued)


def run(loads: list[ShardLoad], current: int, settings: AutoscalingSettings = SETTINGS, tick_s: float = 0.5,
        start_s: float = 0.0) -> list[int]:
    """The count after each tick, the count fed back (a replica asked for is counted at once)."""
    state, counts = ScalingState(), []
    for k, shard in enumerate(loads):
        current, state = decide(shard, current, settings, state, start_s + k * tick_s)
        counts.append(current)
    return counts


def test_out_of_bounds_is_brought_back_at_once() -> None:
    assert decide(load(0, 0), 0, SETTINGS, ScalingState(), 0.0)[0] == 1  # below min
    assert decide(load(12, 0), 12, SETTINGS, ScalingState(), 0.0)[0] == 8  # above max, whatever the load
    fixed = AutoscalingSettings.fixed(3)
    assert run([load(3, 3 * SLOTS * 4)] * 20, 3, fixed) == [3] * 20  # a fixed shard never changes
    assert run([load(3, 0)] * 400, 3, fixed)[-1] == 3


def test_up_fast_all_at_once_after_the_upscale_delay() -> None:
    # 2 replicas full and 50 waiting: 178 slots asked, 4 replicas at 80% of theirs; asked for 2 s, then all at once
    counts = run([load(2, 2 * SLOTS + 50)] * 10, 2)
    assert counts[:4] == [2, 2, 2, 2] and counts[4:] == [4] * 6


def test_up_never_above_max_and_a_queue_counts_up_to_the_slots_there_are() -> None:
    assert run([load(4, 4 * SLOTS + 1000)] * 10, 4)[-1] == 8  # max
    assert run([load(1, SLOTS + 1000)] * 10, 1)[-1] == 3  # 64 + 64 slots asked: 3 at 80%, not one per 51 queued


def test_from_zero_at_once_when_a_request_waits() -> None:
    sleepy = AutoscalingSettings(min_replicas=0, max_replicas=4)
    assert decide(load(0, 0, queued=3), 0, sleepy, ScalingState(), 0.0)[0] == 1
    assert decide(load(0, 0), 0, sleepy, ScalingState(), 0.0)[0] == 0


def test_late_first_tokens_or_a_prefill_backlog_ask_for_one_more() -> None:
    late = ShardLoad(num_ready=2, num_starting=0, num_slots=2 * SLOTS, num_running=80, num_waiting=5, ttft_p90_s=2.0)
    assert run([late] * 6, 2)[-1] == 3
    on_time = ShardLoad(num_ready=2, num_starting=0, num_slots=2 * SLOTS, num_running=80, num_waiting=5, ttft_p90_s=0.5)
    assert run([on_time] * 6, 2)[-1] == 2
    assert run([load(2, 80, backlog_s=1.0)] * 6, 2)[-1] == 3
    assert run([load(2, 80, backlog_s=1.0, starting=1)] * 6, 3)[-1] == 3  # what starts is the answer: not one more


def test_down_to_what_the_longer_average_fits_at_most_half_at_once() -> None:
    counts = run([load(6, 60)] * 400, 6)  # 200 s of a load that fits 2 replicas at the lower target (65%)
    drops = [k for k in range(1, len(counts)) if counts[k] < counts[k - 1]]
    assert drops[0] * 0.5 >= 60.0  # not before the average has seen the delay's demand
    assert all(counts[k] >= (counts[k - 1] + 1) // 2 for k in drops)  # at most half at once
    assert counts[drops[0]] == 3 and counts[-1] == 2  # 6 -> 3 -> 2, never below what it fits in, and then it stays
    assert len(drops) == 2


def test_a_fall_is_followed_as_the_average_forgets_what_came_before() -> None:
    # 20 s at 120 slots asked (3 replicas at 65%), then 20 slots (1): down in steps, each at most half, to 1
    counts = run([load(6, 120)] * 40 + [load(6, 20)] * 400, 6)
    drops = [k for k in range(1, len(counts)) if counts[k] < counts[k - 1]]
    assert all(counts[k] >= (counts[k - 1] + 1) // 2 for k in drops) and counts[-1] == 1
    assert drops[0] * 0.5 >= 60.0  # not before the average has seen the delay's demand


def test_no_flapping_between_the_two_targets() -> None:
    # 130 and 200 slots asked, in turn: above what 3 replicas hold at the lower target (65%), within 4 at 80%
    assert set(run([load(4, 130), load(4, 200)] * 300, 4)) == {4}
    # a spike shorter than the upscale delay changes nothing; a dip the average hardly sees neither
    assert set(run([load(4, 130)] * 2 + [load(4, 300)] * 2 + [load(4, 130)] * 20, 4)) == {4}
    assert set(run(([load(4, 60)] * 20 + [load(4, 200)] * 40) * 10, 4)) == {4}  # 10 s dips, 20 s back


def test_no_flapping_with_the_default_settings() -> None:
    default = AutoscalingSettings(max_replicas=8)  # target 0.8 up and down, the way down's average over 30 s
    # 150 and 200 slots asked in turn: above what 3 replicas hold at 80% (153.6) at times, within 4 (204.8)
    assert set(run([load(4, 150), load(4, 200)] * 300, 4, default)) == {4}
    # 4 s dips (without the lead: a return from a dip reads as a growing demand)
    dips = ([load(4, 60)] * 8 + [load(4, 200)] * 40) * 10
    assert set(run(dips, 4, replace(default, lead_s=0.0))) == {4}
    assert run([load(4, 60)] * 200, 4, default)[-1] == 2  # the same dip, lasting: down


def test_a_replica_just_ready_drains_the_queue_before_it_asks_again() -> None:
    # 1 replica with a queue (150 slots asked): 3 asked for; as the second one becomes ready, the queue it drains
    # asks for no more for a while, though it asks for 3 at 80% at once
    queued = [load(1, 150, starting=1)] * 10 + [load(2, 150)] * 20
    assert run(queued, 2)[-1] == 2
    assert run([load(2, 150)] * 30, 2)[-1] == 3  # the same queue on replicas ready all along: one more


def test_down_at_once_never_below_min() -> None:
    floor = AutoscalingSettings(min_replicas=3, max_replicas=8, downscale_delay_s=60.0, lead_s=0.0)
    counts = run([load(6, 10)] * 400, 6, floor)
    assert min(counts) == 3 and counts[-1] == 3


def test_never_down_while_a_replica_is_starting() -> None:
    assert set(run([load(4, 10, starting=1)] * 400, 5)) == {5}


def test_to_zero_only_after_idle_and_only_with_min_zero() -> None:
    sleepy = AutoscalingSettings(min_replicas=0, max_replicas=4, idle_s=300.0, downscale_delay_s=60.0)
    busy_then_idle = [load(1, 5)] * 200 + [load(1, 0)] * 800  # the last request seen at 99.5 s
    counts = run(busy_then_idle, 1, sleepy)
    assert counts.index(0) * 0.5 == pytest.approx(99.5 + 300.0)
    assert run([load(1, 0)] * 1000, 1)[-1] == 1  # min 1: never zero


def test_a_growing_demand_is_followed_ahead() -> None:
    growing = [load(4, 100 + k) for k in range(200)]  # +2 slots asked a second
    ahead = run(growing, 4, AutoscalingSettings(min_replicas=1, max_replicas=16, lead_s=20.0, upscale_delay_s=2.0))
    now = run(growing, 4, AutoscalingSettings(min_replicas=1, max_replicas=16, lead_s=0.0, upscale_delay_s=2.0))
    assert all(a >= b for a, b in zip(ahead, now)) and any(a > b for a, b in zip(ahead, now))


def test_the_state_is_plain_data() -> None:
    _, state = decide(load(2, 200), 2, SETTINGS, ScalingState(), 1.0)
    assert ScalingState.from_dict(state.as_dict()) == state
    assert state.up_since_s == 1.0


@pytest.mark.parametrize("bad", [
    {"min_replicas": 3, "max_replicas": 2}, {"max_replicas": 0}, {"min_replicas": -1}, {"target_utilization": 0},
    {"target_utilization": 1.5}, {"downscale_margin": 0.9}, {"upscale_delay_s": -1}, {"ttft_slo_s": 0},
])
def test_settings_are_checked(bad: dict) -> None:
    with pytest.raises(ValueError):
        AutoscalingSettings(**{"max_replicas": 4, **bad})


@pytest.mark.parametrize("name", ["upscale_delay_s", "downscale_delay_s", "idle_s", "lead_s", "ttft_slo_s", "backlog_s"])
@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_a_time_that_is_not_finite_is_refused_by_name(name: str, value: float) -> None:
    with pytest.raises(ValueError, match=name):  # NaN never passes a delay; an infinite lead makes the demand NaN
        AutoscalingSettings(**{"max_replicas": 4, name: value})


@pytest.mark.parametrize("bad", [
    ShardLoad(num_ready=1, num_starting=0, num_slots=SLOTS, num_running=float("nan"), num_waiting=0),
    ShardLoad(num_ready=1, num_starting=0, num_slots=SLOTS, num_running=-5, num_waiting=-3, backlog_s=float("nan"),
              ttft_p90_s=float("nan")),
    ShardLoad(num_ready=1, num_starting=0, num_slots=-SLOTS, num_running=2, num_waiting=0),
])
def test_a_report_out_of_range_counts_as_none_and_does_not_poison_the_state(bad: ShardLoad) -> None:
    """A replica's report with NaN or negative numbers (a metric not there yet): no error, no move, and the
    demand's averages stay numbers, so the next good report is read as it is."""
    state = ScalingState()
    for k in range(10):
        count, state = decide(bad, 2, SETTINGS, state, k * 0.5)
        assert count == 2
    assert state.demand == state.demand and state.demand_slow == state.demand_slow  # not NaN
    count, state = decide(load(2, 10 * SLOTS), 2, SETTINGS, state, 5.0)  # a replica more ready: it settles first
    count, state = decide(load(2, 10 * SLOTS), count, SETTINGS, state, 25.0)
    count, state = decide(load(2, 10 * SLOTS), count, SETTINGS, state, 27.5)
    assert count > 2  # the good report is read as it is: the shard grows


def test_replicas_that_report_no_slots_yet_are_not_taken_away_while_requests_wait() -> None:
    no_slots = ShardLoad(num_ready=2, num_starting=0, num_slots=0, num_running=0, num_waiting=6)
    assert run([no_slots] * 400, current=2) == [2] * 400  # 200 s, past the downscale delay
