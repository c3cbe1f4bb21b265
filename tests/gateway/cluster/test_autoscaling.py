"""Serve's autoscaling of a shard, its pure parts: the replicas' phases read from Serve's status
(gateway/cluster/membership.py), and the shard's decision shared by its deployments' policies
(gateway/cluster/autoscaling.py). Serve itself: tests/gateway/test_serve_autoscaling.py."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from gateway.cluster.autoscaling import (
    FIRST_HEARD_S,
    RESTART_GUARD_S,
    ReplicaReport,
    ShardPolicy,
    ShardScaler,
    deployment_autoscaling,
    report_of,
    scaler,
    shard_load,
)
from gateway.cluster.membership import ASLEEP, DRAINING, STARTING, UP, Membership, phase_of
from gateway.policy.autoscale import AutoscalingSettings
from gateway.requests.health import _shard_state


@pytest.mark.parametrize("status, states, phase", [
    ("HEALTHY", {"RUNNING": 1}, UP),
    ("UPSCALING", {"STARTING": 1}, STARTING),
    ("UPSCALING", {"RUNNING": 1}, UP),
    ("DOWNSCALING", {"RUNNING": 0, "STOPPING": 1}, DRAINING),
    ("DOWNSCALING", {"RUNNING": 1}, DRAINING),  # scaled down while it still runs: it drains
    ("HEALTHY", {}, ASLEEP),
    ("UNHEALTHY", {"STOPPING": 1}, STARTING),  # replaced after a crash: not routed to until it runs again
])
def test_a_replicas_phase_follows_serves_status(status, states, phase) -> None:
    assert phase_of(status, states) == phase


def test_a_replica_is_routed_to_only_once_it_took_its_pins_and_drains_when_scaled_down() -> None:
    joined, left, fail_join = [], [], [True]

    async def join(replica_id: str) -> None:
        if fail_join[0]:
            fail_join[0] = False
            raise ConnectionError("not yet")
        joined.append(replica_id)

    async def scenario() -> None:
        members = Membership(["s-0", "s-1"], lambda: {}, join, left.append)
        assert members.phase("s-0") == STARTING and members.phase("other-0") == UP  # fixed shards are always up
        await members.update({"s-0": ("HEALTHY", {"RUNNING": 1}), "s-1": ("HEALTHY", {})})
        assert members.phase("s-0") == STARTING and members.serving["s-0"]  # its pins did not go: not yet
        await members.update({"s-0": ("HEALTHY", {"RUNNING": 1}), "s-1": ("UPSCALING", {"STARTING": 1})})
        assert (members.phase("s-0"), members.phase("s-1"), joined) == (UP, STARTING, ["s-0"])
        await members.update({"s-0": ("HEALTHY", {"RUNNING": 1}), "s-1": ("HEALTHY", {"RUNNING": 1})})
        assert members.phase("s-1") == UP and joined == ["s-0", "s-1"] and left == []
        await members.update({"s-0": ("HEALTHY", {"RUNNING": 1}), "s-1": ("DOWNSCALING", {"STOPPING": 1})})
        assert members.phase("s-1") == DRAINING and left == ["s-1"]
        await members.update({"s-0": ("HEALTHY", {"RUNNING": 1}), "s-1": ("HEALTHY", {})})
        assert members.phase("s-1") == ASLEEP and left == ["s-1"]  # left once

    asyncio.run(scenario())


def test_membership_keeps_its_phases_when_serve_cannot_be_read() -> None:
    calls = []

    def read():
        calls.append(1)
        if len(calls) > 1:
            raise ConnectionError("the controller restarts")
        return {"s-0": ("HEALTHY", {"RUNNING": 1})}

    async def scenario() -> None:
        members = Membership(["s-0"], read)
        task = asyncio.create_task(members.run())
        while len(calls) < 3:
            await asyncio.sleep(0.05)
        task.cancel()
        assert members.phase("s-0") == UP

    asyncio.run(scenario())


def report(index: int, wanted: bool = True, up: bool = True, queued: float = 0.0, **metrics: float) -> ReplicaReport:
    return ReplicaReport(index, wanted, up, {"slots": 4.0, "running": 0.0, "waiting": 0.0, "backlog_s": 0.0,
                                            "ttft_p90_s": -1.0, **metrics} if up else {}, queued)


def test_the_shards_load_sums_its_running_replicas_and_counts_those_starting() -> None:
    reports = [report(0, running=3.0, waiting=2.0, backlog_s=0.4, ttft_p90_s=0.3), report(1, running=4.0, backlog_s=0.2, ttft_p90_s=1.5),
               report(2, wanted=False, up=False), report(3, wanted=False, up=False, queued=5)]
    load = shard_load({r.index: r for r in reports}, 3)  # index 2 asked for since its report: starting
    assert (load.num_ready, load.num_starting, load.num_slots, load.num_running, load.num_waiting) == (2, 1, 8, 7, 2)
    assert load.backlog_s == pytest.approx(0.3) and load.ttft_p90_s == 1.5 and load.num_queued == 5


def test_one_decision_per_tick_for_all_of_a_shards_deployments() -> None:
    settings = AutoscalingSettings(min_replicas=1, max_replicas=3, upscale_delay_s=0.0, target_utilization=0.5)
    scaler = ShardScaler(settings)
    busy = {"running": 4.0, "waiting": 4.0}
    assert [scaler.replicas_for(report(i, i == 0, i == 0), 9.5 + i * 0.01) for i in range(3)] == [1, 0, 0]  # as Serve has
    answers = [scaler.replicas_for(report(0, **busy), 10.0), scaler.replicas_for(report(1, False, False), 10.01),
               scaler.replicas_for(report(2, False, False), 10.02)]
    assert answers == [1, 1, 1] and scaler.wanted == 3  # all of the tick's answers follow its one decision
    for now in (10.5, 11.0, 11.5):  # the next ticks: the others' reports still show the targets before it (a tick old)
        assert [scaler.replicas_for(report(i, False, False) if i else report(0, **busy), now + i * 0.001) for i in range(3)] == [1, 1, 1]
    # quiet for long: down one at a time, the highest index first, never below min_replicas
    now, counts = 11.0, []
    while now < 2000:
        counts.append(sum(scaler.replicas_for(report(i, i < scaler.wanted, i < scaler.wanted), now + i * 0.001) for i in range(3)))
        now += 1.0
    assert counts[-1] == 1 and all(b in (a, a - 1) for a, b in zip(counts, counts[1:]))
    assert scaler.replicas_for(report(0), now) == 1 and scaler.replicas_for(report(2, False, False), now) == 0


class Ctx(SimpleNamespace):
    pass


def test_serves_context_becomes_a_report_and_the_policy_answers_per_deployment() -> None:
    point = SimpleNamespace
    ctx = Ctx(app_name="app-test-report", running_replicas=["r1"], target_num_replicas=1, total_queued_requests=3.0, current_time=100.0,
              raw_metrics={"running": {"r1": [point(timestamp=1.0, value=1.0), point(timestamp=2.0, value=6.0)]},
                           "slots": {"r1": [point(timestamp=2.0, value=8.0)]}, "other": {"r1": [point(timestamp=2.0, value=9.0)]}})
    assert report_of(0, ctx) == ReplicaReport(0, True, True, {"running": 6.0, "slots": 8.0}, 0.0)
    asleep = Ctx(app_name="app-test-report", running_replicas=[], target_num_replicas=0, total_queued_requests=2.0,
                 current_time=100.0, raw_metrics={})
    assert report_of(1, asleep) == ReplicaReport(1, False, False, {}, 2.0)
    settings = AutoscalingSettings(min_replicas=1, max_replicas=2)
    assert ShardPolicy("s", 0, vars(settings))(ctx) == (1, {})
    assert ShardPolicy("s", 1, vars(settings))(asleep)[0] in (0, 1)


def test_each_deployment_is_bounded_by_min_replicas_and_has_no_delay_of_serves_own() -> None:
    settings = AutoscalingSettings(min_replicas=2, max_replicas=4)
    configs = [deployment_autoscaling("s", i, settings) for i in range(4)]
    assert [(c.min_replicas, c.max_replicas, c.initial_replicas) for c in configs] == [(1, 1, 1), (1, 1, 1), (0, 1, 0), (0, 1, 0)]
    assert all(c.upscale_delay_s == c.downscale_delay_s == c.downscale_to_zero_delay_s == 0 for c in configs)
    assert configs[3].policy.policy_kwargs == {"shard": "s", "index": 3, "settings": vars(settings)}


def test_a_shard_is_down_only_when_none_of_its_replicas_that_should_serve_does() -> None:
    up = {"healthy": True, "phase": "up"}
    assert _shard_state({"healthy": 1, "replicas": [up, {"healthy": False, "phase": "starting"}]}) == "ok"
    assert _shard_state({"healthy": 1, "replicas": [up, {"healthy": False}]}) == "degraded"  # one that should serve does not
    assert _shard_state({"healthy": 0, "replicas": [{"healthy": False, "phase": "starting"}]}) == "down"
    assert _shard_state({"healthy": 0, "replicas": [{"healthy": False, "phase": "asleep"}] * 2}) == "ok"


def test_a_replica_serve_started_itself_for_a_request_queued_is_the_shards_and_is_not_stopped_at_once() -> None:
    settings = AutoscalingSettings(min_replicas=0, max_replicas=1, idle_s=5.0)
    scaler = ShardScaler(settings)
    assert scaler.replicas_for(report(0, False, False), 100.0) == 0  # asleep, long idle
    assert scaler.replicas_for(report(0, False, False), 200.0) == 0
    # Serve's cold start gave it a replica (a request queued at a handle), before its records come
    assert scaler.replicas_for(ReplicaReport(0, True, True, {}), 201.0) == 1
    assert scaler.replicas_for(ReplicaReport(0, True, True, {}), 203.0) == 1  # not idle yet: it was woken for a request
    assert scaler.replicas_for(report(0), 207.0) == 0  # idle_s without a request: asleep again
    assert scaler.replicas_for(report(0, False, True), 207.5) == 0  # draining: not taken back


class Deployment:
    """One autoscaled shard's deployment as Serve's controller keeps it: its target, whether its replica runs,
    the requests its handles hold for it; `tick` asks its policy as Serve 2.60 does."""

    def __init__(self, app: str, index: int, settings: AutoscalingSettings, target: int) -> None:
        from ray.serve.autoscaling_policy import _apply_autoscaling_config

        self.app, self.config = app, deployment_autoscaling("s", index, settings)
        self.policy = _apply_autoscaling_config(ShardPolicy("s", index, vars(settings)))  # what Serve calls
        self.target, self.is_running, self.queued, self.policy_state = target, bool(target), 0.0, {}
        self.busy = False

    def tick(self, now_s: float) -> int:
        """Serve's cold start first (no replica running, requests held: one, the policy not asked), then the bounds."""
        load = {"slots": 4.0, "running": 4.0 if self.busy else 0.0, "waiting": 4.0 if self.busy else 0.0}
        ctx = Ctx(app_name=self.app, current_num_replicas=int(self.is_running), running_replicas=["r"] if self.is_running else [],
                  target_num_replicas=self.target, total_num_requests=self.queued, total_queued_requests=self.queued,
                  current_time=now_s, config=self.config, policy_state=self.policy_state,
                  raw_metrics={k: {"r": [SimpleNamespace(timestamp=now_s, value=v)]} for k, v in load.items()} if self.is_running else {})
        decision, self.policy_state = self.policy(ctx)
        self.target = min(max(decision, self.config.min_replicas), self.config.max_replicas)
        return self.target


def serve_ticks(deployments: list[Deployment], start_s: float, until) -> float:
    """Serve's controller ticks (0.5 s apart) over `deployments` from `start_s` until `until()`; when it stopped.
    A deployment Serve scales to zero stops (it drains: no replica counted as running)."""
    now = start_s
    while not until():
        for d in deployments:
            d.tick(now)
            d.is_running = d.is_running and d.target == 1
        now += 0.5
        assert now < start_s + 3600, "never happened"
    return now


def test_a_call_routed_to_a_replica_just_scaled_down_does_not_start_it_again_for_good() -> None:
    settings = AutoscalingSettings(min_replicas=1, max_replicas=2, upscale_delay_s=0.0, downscale_delay_s=1.0)
    app = "app-test-stray-call"
    first, second = Deployment(app, 0, settings, 1), Deployment(app, 1, settings, 0)
    first.busy = True
    now = serve_ticks([first, second], 100.0, lambda: second.target == 1)
    second.is_running, second.busy, first.busy = True, True, True
    now = serve_ticks([first, second], now, lambda: True) + 1.0
    first.busy = second.busy = False  # quiet: the highest index goes
    stopped_s = serve_ticks([first, second], now, lambda: second.target == 0)
    shard = scaler(app, "s", settings)
    # a call the gateway routed to it before its next reading waits at Serve's router: Serve's cold start gives
    # the deployment a replica, without asking the policy
    second.queued = 1.0
    assert second.tick(stopped_s + 0.5) == 1 and shard.answered[1] == 0
    second.queued = 0.0  # the gateway's drain withdrew it; the replica still starts: the policy is asked again
    assert second.tick(stopped_s + 2.0) == 0 and shard.wanted == 1  # not the shard's: it goes back to zero
    second.queued = 1.0  # another one, and the replica ran before it was withdrawn (it took the call)
    assert second.tick(stopped_s + 2.5) == 1
    second.is_running, second.queued = True, 0.0
    assert second.tick(stopped_s + 4.0) == 0 and first.tick(stopped_s + 4.0) == 1 and shard.wanted == 1
    assert shard.state.busy_s < stopped_s  # nor did they count as demand
    # long after the stop, a replica Serve starts is taken as before: the shard's, and it was busy
    second.is_running, second.queued = False, 1.0
    later = stopped_s + RESTART_GUARD_S + 1.0
    assert second.tick(later) == 1
    second.is_running, second.queued = True, 0.0
    second.tick(later + 0.5)
    assert shard.state.busy_s == later + 0.5


def test_a_shard_asleep_is_woken_by_its_first_request_even_just_after_it_fell_asleep() -> None:
    settings = AutoscalingSettings(min_replicas=0, max_replicas=2, idle_s=5.0)
    app = "app-test-wake"
    first, second = Deployment(app, 0, settings, 0), Deployment(app, 1, settings, 0)
    first.is_running = True
    first.target = 1
    asleep_s = serve_ticks([first, second], 100.0, lambda: first.target == 0)
    shard = scaler(app, "s", settings)
    assert shard.wanted == 0
    first.queued = 1.0  # the gateway's wake: a call to the shard's first deployment
    assert first.tick(asleep_s + 0.5) == 1 and first.tick(asleep_s + 1.0) == 1  # Serve's cold start
    first.is_running, first.queued = True, 0.0
    assert first.tick(asleep_s + 3.0) == 1 and second.tick(asleep_s + 3.0) == 0 and shard.wanted == 1
    assert first.tick(asleep_s + 6.0) == 1  # the shard was busy from its wake: not asleep again before idle_s


def test_a_fresh_scaler_keeps_the_replicas_serve_runs_until_it_has_heard_from_its_whole_shard() -> None:
    """Serve's controller restarted with three replicas running: the shard is taken for three, not for the
    one whose report came first (which would stop the other two)."""
    settings = AutoscalingSettings(min_replicas=1, max_replicas=3, upscale_delay_s=0.0, target_utilization=0.5)
    scaler = ShardScaler(settings)
    light = {"slots": 4.0, "running": 1.0}
    answers = [scaler.replicas_for(report(i, **light), 50.0 + i * 0.01) for i in range(3)]
    assert answers == [1, 1, 1] and scaler.wanted == 3  # decided once all three were heard, from three
    for now in (50.5, 51.0):  # and not lowered at once: no way down in the shard's first downscale_delay_s
        assert [scaler.replicas_for(report(i, **light), now + i * 0.001) for i in range(3)] == [1, 1, 1]
    alone = ShardScaler(settings)  # a deployment that never reports does not hold the decision for longer
    assert alone.replicas_for(report(0, **light), 60.0) == 1 and alone.wanted is None
    assert alone.replicas_for(report(0, **light), 60.0 + FIRST_HEARD_S) == 1 and alone.wanted == 1
