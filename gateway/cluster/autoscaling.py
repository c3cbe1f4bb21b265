"""A shard's replicas follow demand through Ray Serve's own autoscaling (docs/configuration.md#autoscaling).

Every replica of a shard is its own Serve deployment, so that the gateway chooses the replica
a request goes to (gateway/serve.py). An autoscaled shard's deployments each hold zero or one
Serve replica, as Serve's autoscaler decides with `ShardPolicy`, our custom `AutoscalingPolicy`:
Serve calls it for each deployment on each tick of its controller, with that deployment's
context (its target, its running replica, the metrics the replica records with
`record_autoscaling_stats`, requests queued at handles while it has none). The policies of one
shard's deployments share a `ShardScaler` in the controller: it gathers their reports into the
shard's `ShardLoad`, and once per tick calls `decide` (gateway/policy/autoscale.py, the function
the fleet simulator runs) for the count of replicas; the deployments with an index below it
keep or get their replica, the others are scaled to zero. Scaling down takes the highest index
first; the gateway drains it (gateway/cluster/membership.py) before Serve stops it.

Serve's cold start does not ask the policy: a deployment with no running replica whose handles hold
requests for it is given one at once; the policy is called again once that replica runs, or the
requests are gone. The scaler then adopts the replica (the gateway woke the shard: gateway/serve.py
`wake`), unless it stopped that deployment moments before (`ShardScaler.is_stray`).

Serve applies its own delays, factors and bounds to a policy's answer: each deployment is
configured (`deployment_autoscaling`) with no delay and a factor of 1, so the timers of `decide`
are the only ones, and with bounds 0..1 (1..1 for an index below `min_replicas`).

Why shared state in the controller, rather than Serve's application-level policy (one call with
every deployment's context): Serve takes that policy only from a declarative config, and
`loraplex serve` deploys with `serve.run_many`; the per-deployment hook is there on both paths.
Serve pickles a policy's module by value: `ShardPolicy` reaches the shared scalers through this
module imported by name in the controller, not through the copy it was pickled with.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, replace
from typing import Any

from gateway.policy.autoscale import AutoscalingSettings, ScalingState, ShardLoad, decide

TICK_S = 0.05  # the deployments' policies of one controller tick share one decision (ticks are 0.1-0.5 s apart)
METRICS_PUSH_S = 1.0  # how often a replica sends its records to the controller
LOOK_BACK_S = 2.0  # Serve's own aggregates (its cold start's request count) look back this far
# A call the gateway routed to a replica before it read that the replica was scaled down waits at Serve's
# router (it does not route to a stopping replica) until the gateway's next reading (every 0.5 s) withdraws
# it, with the cancels sent to that replica (gateway/cluster/channel.py); Serve's controller sees the queue
# empty with the handle's next report (within 2 s) and our policy is called on the next tick. Serve's cold
# start may have started the deployment again for such a call meanwhile: within this long of the scaler
# stopping a deployment, Serve starting it again is not taken as demand (the deployment goes back to zero).
RESTART_GUARD_S = 10.0
# A fresh scaler (the deployment is new, or Serve's controller restarted, with replicas running) decides first
# once it has heard from every deployment of its shard, or this long after the first: from fewer it would take
# the shard for smaller than it is and stop replicas that serve. Until then each deployment keeps Serve's target.
FIRST_HEARD_S = 2.0
METRICS = ("slots", "running", "waiting", "backlog_s", "ttft_p90_s")  # what a replica records (worker/shard/worker.py)


@dataclass(frozen=True)
class ReplicaReport:
    """One of the shard's deployments on one tick, as its context shows it."""

    index: int
    is_wanted: bool  # Serve's target for it is one replica
    is_running: bool  # ... and one runs
    metrics: Mapping[str, float]  # its replica's latest records (none while nothing runs)
    num_queued: float = 0.0  # requests waiting at handles for it while it has no replica


def shard_load(reports: Mapping[int, ReplicaReport], wanted: int) -> ShardLoad:
    """The shard's load over its deployments' latest reports, the first `wanted` of them asked for
    (those not running yet are starting)."""
    running = [r for r in reports.values() if r.is_running]

    def total(name: str) -> float:
        return sum(max(0.0, r.metrics.get(name, 0.0)) for r in running)

    ttfts = [r.metrics["ttft_p90_s"] for r in running if r.metrics.get("ttft_p90_s", -1.0) >= 0]
    return ShardLoad(
        num_ready=len(running), num_starting=sum(i not in reports or not reports[i].is_running for i in range(wanted)),
        num_slots=int(total("slots")), num_running=int(total("running")), num_waiting=int(total("waiting")),
        backlog_s=total("backlog_s") / len(running) if running else 0.0,
        ttft_p90_s=max(ttfts) if ttfts else None,
        num_queued=int(sum(r.num_queued for r in reports.values() if not r.is_running)),
    )


class ShardScaler:
    """One shard's decision, shared by its deployments' policies: each tick, the first policy
    called decides from the latest report of every deployment; all of that tick's answers follow it."""

    def __init__(self, settings: AutoscalingSettings) -> None:
        self.settings = settings
        self.state = ScalingState()
        self.reports: dict[int, ReplicaReport] = {}
        self.wanted: int | None = None
        self.decided_s: float | None = None
        self.answered: dict[int, int] = {}  # what it last answered for each deployment
        self.stopped_s: dict[int, float] = {}  # when it last answered 0 for each deployment after another answer
        self.first_heard_s: float | None = None  # its first report (a fresh scaler decides once it has heard them all)

    def replicas_for(self, report: ReplicaReport, now_s: float) -> int:
        """The replicas (0 or 1) of the deployment `report` is about. The shard's current count is
        what it last decided (the other deployments' reports are a tick old: their targets may not
        show it yet); at first, once it has heard from them all, the targets Serve has. A deployment Serve gave a replica that this
        scaler had answered 0 for was started by Serve itself (its cold start: a request queued at a
        handle for a deployment with none): the shard has it now, and was busy, unless `is_stray`."""
        self.reports[report.index] = report
        if self.first_heard_s is None:
            self.first_heard_s = now_s
        if self.wanted is None and not self._heard_all(now_s):
            self.answered[report.index] = int(report.is_wanted)
            return int(report.is_wanted)
        if (self.wanted is not None and report.index >= self.wanted and report.is_wanted
                and self.answered.get(report.index) == 0 and not self.is_stray(report.index, now_s)):
            self.wanted = report.index + 1
            self.state = replace(self.state, busy_s=now_s)
        if self.wanted is None or self.decided_s is None or now_s - self.decided_s >= TICK_S:
            current = self.wanted if self.wanted is not None else sum(r.is_wanted for r in self.reports.values())
            self.wanted, self.state = decide(shard_load(self.reports, current), current, self.settings, self.state, now_s)
            self.decided_s = now_s
        answer = 1 if report.index < self.wanted else 0
        if answer == 0 and self.answered.get(report.index) != 0:
            self.stopped_s[report.index] = now_s
        self.answered[report.index] = answer
        return answer

    def _heard_all(self, now_s: float) -> bool:
        """Whether a fresh scaler knows its shard (FIRST_HEARD_S)."""
        return len(self.reports) >= self.settings.max_replicas or now_s - self.first_heard_s >= FIRST_HEARD_S

    def is_stray(self, index: int, now_s: float) -> bool:
        """Whether Serve's start of deployment `index`, which this scaler stopped, is for calls the gateway
        routed to it before it read the stop (RESTART_GUARD_S): the gateway withdraws those and sends them
        elsewhere. A shard asleep is woken only through its first deployment (gateway/serve.py `wake`):
        a start of it while the shard has none is always taken."""
        if index == 0 and self.wanted == 0:
            return False
        stopped_s = self.stopped_s.get(index)
        return stopped_s is not None and now_s - stopped_s < RESTART_GUARD_S


_SCALERS: dict[tuple[str, str], ShardScaler] = {}  # by (application, shard), in the controller's process


def scaler(app: str, shard: str, settings: AutoscalingSettings) -> ShardScaler:
    """The shard's scaler (its settings as last deployed)."""
    found = _SCALERS.get((app, shard))
    if found is None:
        found = _SCALERS[(app, shard)] = ShardScaler(settings)
    found.settings = settings
    return found


def report_of(index: int, ctx: Any) -> ReplicaReport:
    """A deployment's report from Serve's AutoscalingContext: its replica's latest record of each metric."""
    is_running = bool(ctx.running_replicas)
    metrics: dict[str, float] = {}
    if is_running:
        for name, by_replica in (ctx.raw_metrics or {}).items():
            series = [s for s in by_replica.values() if s]
            if name in METRICS and series:
                metrics[name] = float(max(series, key=lambda s: s[-1].timestamp)[-1].value)
    queued = 0.0 if is_running else float(ctx.total_queued_requests or 0.0)
    return ReplicaReport(index, ctx.target_num_replicas >= 1, is_running, metrics, queued)


class ShardPolicy:
    """Serve's custom policy of one autoscaled shard's deployment (Serve builds it with the
    `policy_kwargs` of `deployment_autoscaling`)."""

    def __init__(self, shard: str, index: int, settings: dict[str, Any]) -> None:
        self.shard, self.index = shard, index
        self.settings = AutoscalingSettings(**settings)

    def __call__(self, ctx: Any) -> tuple[int, dict[str, Any]]:
        import gateway.cluster.autoscaling as shared  # the module itself: its scalers are the controller's

        now_s = ctx.current_time if ctx.current_time is not None else time.time()
        shard_scaler = shared.scaler(ctx.app_name or "", self.shard, self.settings)
        return shard_scaler.replicas_for(shared.report_of(self.index, ctx), now_s), {}


def deployment_autoscaling(shard: str, index: int, settings: AutoscalingSettings) -> Any:
    """The `autoscaling_config` of an autoscaled shard's `index`-th deployment."""
    from ray.serve.config import AutoscalingConfig, AutoscalingPolicy

    floor = 1 if index < settings.min_replicas else 0
    return AutoscalingConfig(
        min_replicas=floor, max_replicas=1, initial_replicas=floor,
        upscale_delay_s=0.0, downscale_delay_s=0.0, downscale_to_zero_delay_s=0.0, upscaling_factor=1.0, downscaling_factor=1.0,
        metrics_interval_s=METRICS_PUSH_S, look_back_period_s=LOOK_BACK_S,
        # Serve scales a deployment of no replica up at once when requests were queued for it over the
        # window: with `min`, only when they were throughout (not when a channel closed just before)
        aggregation_function="min",
        policy=AutoscalingPolicy(policy_function=ShardPolicy,
                                 policy_kwargs={"shard": shard, "index": index, "settings": asdict(settings)}),
    )
