"""The scaling policies a simulated shard may use, each deciding from what the shard reports
(`ShardSample`) how many replicas it should have. `ours` is the production function,
gateway.policy.autoscale.decide, unchanged. The others are there to compare against, written here
after their own formulas:

- `fixed`: the count the shard started with, always (today's `replicas`).
- `serve-default`: Ray Serve's default policy (ray/serve/autoscaling_policy.py): requests ongoing
  at the shard's replicas (running and queued), averaged over `look_back_period_s` (30 s), divided
  by `target_ongoing_requests`; a change asked for `upscale_delay_s` (30 s) or `downscale_delay_s`
  (600 s) in a row is made whole (scaling factors 1), and from zero replicas at once.
- `knative`: Knative's KPA, the concurrency autoscaler of KServe's serverless mode: concurrency
  averaged over a stable window (60 s) and a panic window (6 s), divided by the target per replica;
  the panic window's count, once it reaches twice the replicas ready, rules for a stable window and
  never scales down meanwhile; it decides every 2 s, down at most by half each time.
- `queue-depth`: KEDA driving a Kubernetes HPA on the engine's queue depth and running requests, as
  KServe's LLM autoscaling and llm-d's queue-depth path configure it: every 15 s (the HPA's sync
  period) each metric asks for ceil(its sum over the ready replicas / its target per replica), 5
  waiting requests (llm-d's queueLengthThreshold; here those waiting for their adapter's load count
  too) and the running requests' target; the larger wins, a metric within 10% of its target keeps
  the count (the HPA's tolerance), up by at most
  max(4, 100%) a sync, down to the highest count asked over the last 300 s (its stabilization
  window).

Every peer aims at the same share of the replicas' KV slots as ours (`target_utilization`), so that
what differs is what each reads and how it damps, not the target; each is bounded by the shard's
min and max.

Beside them, bench/sim/oracle.py's `Oracle` is told the scenario's rate, which no policy knows: the
bound a per-shard policy can reach, run through `run_scaled` with a builder in place of a name.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from gateway.policy.autoscale import AutoscalingSettings, ScalingState, ShardLoad, decide


@dataclass(frozen=True)
class ShardSample:
    """A shard at one tick: what its replicas report, and the replicas it has or is starting."""

    load: ShardLoad
    current: int  # replicas ready or starting (not draining)
    slots_per_replica: int

    @property
    def ongoing(self) -> int:
        """Requests at its ready replicas, running or queued: Serve's ongoing requests, Knative's concurrency."""
        return self.load.num_running + self.load.num_waiting + self.load.num_queued


class Fixed:
    name = "fixed"

    def __init__(self, settings: AutoscalingSettings) -> None:
        self.settings = settings

    def decide(self, sample: ShardSample, now_s: float) -> int:
        return sample.current


class Ours:
    """gateway.policy.autoscale.decide over the shard's load, its state kept between ticks."""

    name = "ours"

    def __init__(self, settings: AutoscalingSettings) -> None:
        self.settings, self.state = settings, ScalingState()

    def decide(self, sample: ShardSample, now_s: float) -> int:
        replicas, self.state = decide(sample.load, sample.current, self.settings, self.state, now_s)
        return replicas


class _Windows:
    """Samples of one value over time, averaged over the last `window_s`."""

    def __init__(self) -> None:
        self.samples: deque[tuple[float, float]] = deque()

    def add(self, now_s: float, value: float, keep_s: float) -> None:
        self.samples.append((now_s, value))
        while self.samples and self.samples[0][0] <= now_s - keep_s:
            self.samples.popleft()

    def mean(self, now_s: float, window_s: float) -> float:
        values = [v for t, v in self.samples if t > now_s - window_s]
        return sum(values) / len(values) if values else 0.0


class ServeDefault:
    """Ray Serve's default: ongoing requests over the look-back window / target per replica, delayed."""

    name = "serve-default"
    look_back_period_s = 30.0
    upscale_delay_s = 30.0
    downscale_delay_s = 600.0

    def __init__(self, settings: AutoscalingSettings) -> None:
        self.settings = settings
        self.ongoing = _Windows()
        self.since_s: float | None = None  # when the current run of up (or down) decisions began
        self.direction = 0

    def decide(self, sample: ShardSample, now_s: float) -> int:
        s, current = self.settings, sample.current
        self.ongoing.add(now_s, sample.ongoing, self.look_back_period_s)
        if current == 0:  # the cold start path: at once
            return max(1, s.min_replicas) if sample.ongoing else 0
        target_per_replica = s.target_utilization * sample.slots_per_replica
        desired = math.ceil(self.ongoing.mean(now_s, self.look_back_period_s) / target_per_replica - 1e-9)
        desired = min(max(desired, s.min_replicas), s.max_replicas)
        direction = (desired > current) - (desired < current)
        if direction == 0:
            self.since_s, self.direction = None, 0
            return current
        if direction != self.direction:
            self.since_s, self.direction = now_s, direction
        delay_s = self.upscale_delay_s if direction > 0 else self.downscale_delay_s
        if now_s - self.since_s + 1e-6 < delay_s:
            return current
        self.since_s, self.direction = None, 0
        return max(desired, 1) if direction < 0 and current > 1 else desired


class Knative:
    """Knative's KPA: stable and panic windows of concurrency, panic at twice the ready replicas."""

    name = "knative"
    stable_window_s = 60.0
    panic_window_s = 6.0  # 10% of the stable window
    panic_threshold = 2.0  # of the ready replicas' target concurrency
    max_scale_down_rate = 2.0  # per decision
    tick_s = 2.0  # its autoscaler decides this often (the samples are taken every tick of ours)

    def __init__(self, settings: AutoscalingSettings) -> None:
        self.settings = settings
        self.concurrency = _Windows()
        self.panic_until_s: float | None = None
        self.panic_most = 0
        self.decided_s = float("-inf")

    def decide(self, sample: ShardSample, now_s: float) -> int:
        s, current = self.settings, sample.current
        self.concurrency.add(now_s, sample.ongoing, self.stable_window_s)
        if now_s - self.decided_s < self.tick_s - 1e-9:
            return current
        self.decided_s = now_s
        target_per_replica = s.target_utilization * sample.slots_per_replica
        stable = math.ceil(self.concurrency.mean(now_s, self.stable_window_s) / target_per_replica - 1e-9)
        panic = math.ceil(self.concurrency.mean(now_s, self.panic_window_s) / target_per_replica - 1e-9)
        ready = max(sample.load.num_ready, 1)
        if panic / ready >= self.panic_threshold:
            self.panic_until_s = now_s + self.stable_window_s
        if self.panic_until_s is not None and now_s < self.panic_until_s:
            self.panic_most = max(self.panic_most, panic, current)  # in panic: never down
            desired = self.panic_most
        else:
            self.panic_until_s, self.panic_most = None, 0
            desired = max(stable, math.floor(current / self.max_scale_down_rate))
        return min(max(desired, s.min_replicas), s.max_replicas)


class QueueDepth:
    """KEDA's HPA on queue depth and running requests: the larger ask, tolerance, 300 s down window."""

    name = "queue-depth"
    sync_s = 15.0
    waiting_per_replica = 5.0
    tolerance = 0.1
    stabilization_s = 300.0  # down: the highest count asked over this long

    def __init__(self, settings: AutoscalingSettings) -> None:
        self.settings = settings
        self.asked: deque[tuple[float, int]] = deque()
        self.decided_s = float("-inf")

    def decide(self, sample: ShardSample, now_s: float) -> int:
        s, current, load = self.settings, sample.current, sample.load
        if now_s - self.decided_s < self.sync_s - 1e-9:
            return current
        self.decided_s = now_s
        if current == 0:  # KEDA's activation: from zero at the first request
            return max(1, s.min_replicas) if sample.ongoing else 0
        totals = ((load.num_running, s.target_utilization * sample.slots_per_replica),
                  (load.num_waiting + load.num_queued, self.waiting_per_replica))
        desired = max(self._asked(total, target, current) for total, target in totals)
        self.asked.append((now_s, desired))
        while self.asked[0][0] <= now_s - self.stabilization_s:
            self.asked.popleft()
        if desired > current:
            desired = min(desired, current + max(4, current))
        else:
            desired = min(current, max(n for _, n in self.asked))  # the window's highest ask, never up from here
        return min(max(desired, s.min_replicas, 1), s.max_replicas)

    def _asked(self, total: float, target: float, current: int) -> int:
        """An external metric's replicas (the HPA's AverageValue): its sum over the target, within tolerance kept."""
        if abs(total / (target * current) - 1) <= self.tolerance:
            return current
        return math.ceil(total / target - 1e-9)


Policy = Callable[[AutoscalingSettings], Any]  # builds one shard's policy: an object with decide(sample, now_s) -> replicas
SCALERS: dict[str, Callable[[AutoscalingSettings], Fixed | Ours | ServeDefault | Knative | QueueDepth]] = {
    cls.name: cls for cls in (Ours, Fixed, ServeDefault, Knative, QueueDepth)
}
