"""Shards whose replicas follow demand in a simulated fleet: every `tick_s` each shard's policy
(bench/sim/autoscalers.py; `ours` is gateway.policy.autoscale.decide) is given what the shard's
replicas report and says how many replicas it should have.

A replica asked for starts, and takes requests only once started: the profile's
`replica_start_s` (process, engine, model fetched) plus `adapter_fetch_s` for each adapter it
pins (fetched from the store before it serves). A replica no longer wanted is taken out of the
routing at once (a starting one stops there); it finishes what it holds (running, queued, loading
an adapter) and then stops. A replica costs from its start asked for to its stop: replica-seconds
are counted over the measured part of the run (warm-up to duration).

Every replica a shard may have (its max_replicas) is built up front with the shard's pins; those
not serving are kept out of `holders`, so the router never sees them.
"""

from __future__ import annotations

import bisect
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from bench.sim.autoscalers import SCALERS, Policy, ShardSample
from bench.sim.report import percentile
from gateway.policy.autoscale import AutoscalingSettings, ShardLoad

if TYPE_CHECKING:
    from bench.sim.fleet import Fleet

OFF, STARTING, READY, DRAINING = range(4)
TTFT_WINDOW_S = 10.0  # the recent first tokens a shard's TTFT percentiles are over


@dataclass
class ShardReplicas:
    name: str
    indices: list[int]  # every replica it may have, in the fleet's list
    policy: object
    ttft: deque[tuple[float, float]] = field(default_factory=deque)  # (when, TTFT) of its recent first tokens


@dataclass
class ScalingFigures:
    """What a run's scaling cost: replica-seconds over the measured part, and the counts over time."""

    replica_s: float = 0.0
    peak: int = 0
    num_started: int = 0
    num_drained: int = 0
    timeline: list[tuple[float, int]] = field(default_factory=list)  # (tick, replicas costing: starting, ready or draining)
    # (when, replica index, what): "starting", "up", "answered" (its first token since up, to the client: hop_s on),
    # "draining" (out of the routing), "off" (stopped, or a start cancelled)
    events: list[tuple[float, int, str]] = field(default_factory=list)


class Scaler:
    def __init__(self, fleet: Fleet, shards: dict[str, list[int]], settings: AutoscalingSettings, policy: str | Policy,
                 initial: dict[str, int], tick_s: float = 0.5) -> None:
        """`shards`: each shard's replicas (their indices); `initial[shard]` of them serve from the start;
        `policy`: a name in SCALERS, or what builds each shard's policy from the settings."""
        self.fleet, self.settings, self.tick_s = fleet, settings, tick_s
        build = SCALERS[policy] if isinstance(policy, str) else policy
        self.shards = [ShardReplicas(name, indices, build(settings)) for name, indices in shards.items()]
        self.state = [OFF] * len(fleet.replicas)
        self.on_s = [0.0] * len(fleet.replicas)  # since when each replica costs
        self.epoch = [0] * len(fleet.replicas)  # a start cancelled: its ready event is stale
        self.is_answered = [True] * len(fleet.replicas)  # its first token since it was last ready logged as an event
        self.figures = ScalingFigures()
        profile = fleet.profile
        self.start_s = [profile.replica_start_s + len(r.pinned) * profile.adapter_fetch_s for r in fleet.replicas]
        for replica in fleet.replicas:
            replica.ttft_log = []
        fleet.holders.clear()
        fleet.router.all.clear()
        for shard in self.shards:
            for i in shard.indices[:initial[shard.name]]:
                self.state[i] = READY
                self._serve(i)
        fleet.call_at(0.0, self.tick)

    # a replica's life

    def _serve(self, i: int) -> None:
        holders = self.fleet.holders
        for name in self.fleet.replicas[i].pinned:
            bisect.insort(holders.setdefault(name, []), i)
        bisect.insort(self.fleet.router.all, i)

    def _unserve(self, i: int) -> None:
        holders = self.fleet.holders
        for name in self.fleet.replicas[i].pinned:
            holders[name].remove(i)
            if not holders[name]:
                del holders[name]
        self.fleet.router.all.remove(i)

    def _start(self, i: int) -> None:
        now_s = self.fleet.now_s
        self.state[i], self.on_s[i] = STARTING, now_s
        self.figures.num_started += 1
        self.figures.events.append((now_s, i, "starting"))
        self.fleet.call_at(now_s + self.start_s[i], self._ready, i, self.epoch[i])

    def _ready(self, i: int, epoch: int) -> None:
        if epoch != self.epoch[i] or self.state[i] != STARTING:
            return
        self.fleet.replicas[i].restart()  # a new process: empty caches
        if self.fleet.replicas[i].ttft_log is not None:
            self.fleet.replicas[i].ttft_log.clear()  # first tokens of its last life (while it drained)
        self.state[i] = READY
        self.figures.events.append((self.fleet.now_s, i, "up"))
        self.is_answered[i] = False
        self._serve(i)

    def _stop(self, i: int) -> None:
        """Out of the routing now; off once it holds nothing."""
        if self.state[i] == STARTING:
            self.epoch[i] += 1
            self._off(i)
            return
        self._unserve(i)
        self.state[i] = DRAINING
        self.figures.num_drained += 1
        self.figures.events.append((self.fleet.now_s, i, "draining"))
        if not self.fleet.replicas[i].in_flight:
            self._off(i)

    def _off(self, i: int) -> None:
        self.figures.replica_s += self._measured(self.on_s[i], self.fleet.now_s)
        self.state[i] = OFF
        self.figures.events.append((self.fleet.now_s, i, "off"))

    def _measured(self, from_s: float, to_s: float) -> float:
        scenario = self.fleet.scenario
        return max(0.0, min(to_s, scenario.duration_s) - max(from_s, scenario.warmup_s))

    # the policy's tick

    def tick(self) -> None:
        now_s = self.fleet.now_s
        for shard in self.shards:
            for i in shard.indices:
                if self.state[i] == DRAINING and not self.fleet.replicas[i].in_flight:
                    self._off(i)
            target = shard.policy.decide(self.sample(shard, now_s), now_s)  # type: ignore[attr-defined]
            self._apply(shard, target)
        costing = sum(state != OFF for state in self.state)
        self.figures.timeline.append((now_s, costing))
        if now_s >= self.fleet.scenario.warmup_s:
            self.figures.peak = max(self.figures.peak, costing)
        if now_s + self.tick_s < self.fleet.scenario.duration_s:
            self.fleet.call_at(now_s + self.tick_s, self.tick)

    def sample(self, shard: ShardReplicas, now_s: float) -> ShardSample:
        replicas, profile = self.fleet.replicas, self.fleet.profile
        ready = [replicas[i] for i in shard.indices if self.state[i] == READY]
        for r in ready:
            if r.ttft_log and not self.is_answered[r.index]:
                self.is_answered[r.index] = True
                self.figures.events.append((r.ttft_log[0][0] + profile.hop_s, r.index, "answered"))
            shard.ttft.extend((now_s, ttft) for _, ttft in r.ttft_log)
            r.ttft_log.clear()
        while shard.ttft and shard.ttft[0][0] <= now_s - TTFT_WINDOW_S:
            shard.ttft.popleft()
        recent = [ttft for _, ttft in shard.ttft]
        queued_tokens = sum(seq.num_prompt for r in ready for queue in r.queues.values() for seq in queue)
        slots = profile.engine.num_seq_slots
        load = ShardLoad(
            num_ready=len(ready), num_starting=sum(self.state[i] == STARTING for i in shard.indices),
            num_slots=slots * len(ready), num_running=sum(len(r.running) for r in ready),
            num_waiting=sum(r.num_waiting + r.num_loading for r in ready),
            backlog_s=queued_tokens * profile.prompt_token_s / len(ready) if ready else 0.0,
            ttft_p50_s=percentile(recent, 0.5) if recent else None, ttft_p90_s=percentile(recent, 0.9) if recent else None)
        current = sum(self.state[i] in (STARTING, READY) for i in shard.indices)
        return ShardSample(load, current, slots)

    def _apply(self, shard: ShardReplicas, target: int) -> None:
        state, replicas = self.state, self.fleet.replicas
        target = min(target, len(shard.indices))
        live = [i for i in shard.indices if state[i] in (STARTING, READY)]
        if target > len(live):
            for i in [i for i in shard.indices if state[i] == OFF][: target - len(live)]:
                self._start(i)
        elif target < len(live):  # starting ones first, then the ready ones holding the fewest requests
            for i in sorted(live, key=lambda i: (state[i] != STARTING, replicas[i].in_flight))[: len(live) - target]:
                self._stop(i)

    def finish(self) -> ScalingFigures:
        """The run has ended: the replicas still costing, counted to its end."""
        for i, state in enumerate(self.state):
            if state != OFF:
                self.figures.replica_s += self._measured(self.on_s[i], self.fleet.scenario.duration_s)
        return self.figures
