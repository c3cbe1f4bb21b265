"""A fleet in virtual time: an event heap of arrivals and replicas' step ends (no sleeps, no
wall clock). The gateway side is the production code: placement's plan and zipf_shares pin
the adapters, the RateLimiter (per process, on the simulation's clock) admits, a router
(bench/sim/routers.py; `ours` is gateway.policy.routing) picks a replica, and a replica that
refuses (its queue full: 503) sends the request to the next, `max_attempts` in all, as
gateway/requests/dispatch.py does.

Faults (the scenario's `sim.faults`): a replica lost takes what it ran and queued with it: a
stream that had begun fails, any other request is sent to another replica (`max_attempts` in
all, as the gateway retries a whole request when a replica dies); it comes back empty. Redis
down: the shared prefix tier misses and stores nothing meanwhile; Redis slow: each lookup in it
takes longer (with the tier's costs in the profile, a request is looked up when it reaches its
replica, off the step loop as a worker does, and waits for what it fetches).

Churn (`sim.churn`, bench/sim/churn.py) changes the pins while requests run. An aLoRA
pipeline's second call is sent when its first ends; a closed-loop user's next request once its
last has ended (`sim.users`, bench/sim/users.py).

Scaling (`--autoscale`, bench/sim/scaling.py): a Scaler starts and drains replicas as a policy
says, adding them to `holders` once started and taking them out when they drain.

Every request ends exactly once: completed, refused (429 rate limit, 503 busy) or failed (no
replica holds its adapter, longer than a KV slot, its replica lost).
"""

from __future__ import annotations

import heapq
import random
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, replace
from typing import Any

from bench.sim.churn import Churn
from bench.sim.contention import SharedCores
from bench.sim.profile import CostProfile
from bench.sim.record import OUTCOMES, RunRecord
from bench.sim.replica import PrefixCache, ReplicaModel, Seq
from bench.sim.routers import Router, make_router, request_key
from bench.sim.users import ClosedLoop
from bench.sim.workload import BASE, Fault, FleetScenario, SimRequest, requests
from gateway.errors import GatewayError
from gateway.loadtest.scenario import Scenario
from gateway.policy.placement import AdapterSpec, plan, zipf_shares
from gateway.policy.routing import NoCandidateError, ReplicasBusy, RoutingSettings
from gateway.tenancy.ratelimit import RateLimiter
from gateway.tenancy.tenants import Tenant

_STEP, _LOADED, _FAULT, _FETCHED, _ARRIVE, _CALL = range(6)


def run_sync(coro: Coroutine[Any, Any, Any]) -> Any:
    """Run a coroutine that never suspends (the rate limiter's per-process path) to its end."""
    try:
        coro.send(None)
    except StopIteration as stop:
        return stop.value
    coro.close()
    raise RuntimeError("the coroutine suspended: only the rate limiter's per-process mode runs in virtual time")


@dataclass(frozen=True)
class Placement:
    pins: tuple[frozenset[str], ...]  # per replica
    holders: dict[str, list[int]]  # adapter -> replicas pinning it
    shards: tuple[str, ...] = ()  # per replica: its shard (replicas of a shard pin the same adapters)


def place(fleet: FleetScenario, num_replicas: int) -> Placement:
    """Pins per replica from placement.plan over the scenario's initial popularity."""
    mix = fleet.scenario.adapters
    names = [n for n in mix.names if n != BASE]
    if not names:
        return Placement(tuple(frozenset() for _ in range(num_replicas)), {}, tuple(f"shard-{i}" for i in range(num_replicas)))
    shares = zipf_shares(mix.names, mix.zipf_s) if mix.zipf_s is not None else dict(mix.weights)
    shares = {n: s for n, s in shares.items() if n != BASE}
    if fleet.sim.placed_by == "registry":  # no popularity known
        shares = dict.fromkeys(shares, 1.0 / len(shares))
    alora = fleet.scenario.prompts.alora_adapter
    if fleet.scenario.prompts.kind == "alora_pipeline" and alora and alora not in shares:  # every other request is its
        names.append(alora)
        shares = {**{n: s / 2 for n, s in shares.items()}, alora: 0.5}
    result = plan([AdapterSpec(n) for n in names], shares, num_replicas, max_adapters=fleet.sim.max_adapters_per_replica,
                  redundancy=fleet.sim.redundancy)
    pins: list[frozenset[str]] = []
    shards: list[str] = []
    for shard in result.shards:
        pins += [frozenset(shard.adapters)] * shard.replicas
        shards += [shard.name] * shard.replicas
    holders: dict[str, list[int]] = {}
    for i, held in enumerate(pins):
        for name in held:
            holders.setdefault(name, []).append(i)
    for held in holders.values():
        held.sort()
    return Placement(tuple(pins), holders, tuple(shards))


class Fleet:
    def __init__(self, fleet: FleetScenario, scenario: Scenario, profile: CostProfile, placement: Placement, router: str,
                 routing: RoutingSettings = RoutingSettings(), shared_cache: bool | None = None,
                 scaling: Callable[[Fleet], Any] | None = None) -> None:
        """`scaling`: builds the Scaler that starts and stops replicas as a policy says (bench/sim/scaling.py)."""
        self.fleet, self.scenario, self.profile, self.placement = fleet, scenario, profile, placement
        self.routing = routing
        self.now_s = 0.0
        is_shared = fleet.sim.shared_cache if shared_cache is None else shared_cache
        self.shared = shared = PrefixCache(scenario.chunk_tokens, True, 0) if is_shared else None
        has_l1 = shared is None or profile.l2_fetch_token_s is not None  # a replica's own L1 (beside the tier)
        self.replicas = [ReplicaModel(i, profile, PrefixCache(scenario.chunk_tokens, False, profile.l1_chunks) if has_l1
                                      else shared, pins, shared if has_l1 else None)
                         for i, pins in enumerate(placement.pins)]
        self.cores = (SharedCores(profile.shared_cores, profile.serving_cpu_request_s, self.replicas, profile.replica_cpu_request_s,
                                  profile.serving_window_s)
                      if profile.shared_cores else None)
        for replica in self.replicas:
            replica.contention = self.cores
        self.redis_latency_s = 0.0  # a redis_slow fault's, while it lasts
        if any(f.kind == "redis_slow" for f in fleet.sim.faults) and (shared is None or profile.l2_fetch_token_s is None):
            raise ValueError("a redis_slow fault needs a shared tier and a profile with its costs (l2_fetch_token_s)")
        self.rng = random.Random(f"{scenario.seed}-router")
        clock: Callable[[], float] = lambda: self.now_s  # noqa: E731 - the virtual clock every decision reads
        self.holders = {name: list(held) for name, held in placement.holders.items()}  # changes with churn
        self.router: Router = make_router(router, self.replicas, self.holders, routing, self.rng, is_shared, clock)
        self.limiter = RateLimiter(clock=clock)
        limits = fleet.sim.tenant_limits
        self.tenants = {t.name: Tenant(t.name, None, limits[t.name].requests_per_min if t.name in limits else None,
                                       limits[t.name].tokens_per_min if t.name in limits else None)
                        for t in scenario.tenants}
        self.record = RunRecord(router, len(self.replicas))
        self._heap: list[tuple[float, int, int, int, Any]] = []
        self._counter = 0
        self._tried: dict[int, list[int]] = {}  # requests routed and not ended -> the replicas tried
        self._parked: dict[int, SimRequest] = {}  # a request's index -> the one sent once it ends
        self.down: set[int] = set()  # replicas lost, not back yet
        self.churn = Churn(fleet.sim, scenario, placement.shards, self.replicas, self.holders, self.router.pins_changed,
                           self.record, clock, self.call_at, profile.adapter_load_s)
        for fault in fleet.sim.faults:
            self._push(fault.at_s, _FAULT, 0, (fault, True))
            if fault.at_s + fault.for_s < scenario.duration_s:
                self._push(fault.at_s + fault.for_s, _FAULT, 0, (fault, False))
        self.users = ClosedLoop(fleet, scenario, lambda r: self._push(r.at_s, _ARRIVE, 0, r), profile.hop_s)
        self.scaler = scaling(self) if scaling is not None else None

    def _push(self, at_s: float, kind: int, replica: int, payload: Any) -> None:
        self._counter += 1
        heapq.heappush(self._heap, (at_s, self._counter, kind, replica, payload))

    def call_at(self, at_s: float, call: Callable[..., None], *args: Any) -> None:
        """`call(*args)` at virtual time `at_s` (churn's moves)."""
        self._push(at_s, _CALL, 0, (call, args))

    def run(self) -> RunRecord:
        arrivals = requests(self.scenario)
        pending = next(arrivals, None)
        heap = self._heap
        while heap or pending is not None:
            self.record.num_events += 1
            if heap and (pending is None or heap[0][0] <= pending.at_s):
                at_s, _, kind, index, payload = heapq.heappop(heap)
                self.now_s = at_s
                if kind == _STEP:
                    self._step_end(self.replicas[index], payload)
                elif kind == _LOADED or kind == _FETCHED:
                    seq, epoch = payload
                    replica = self.replicas[index]
                    if epoch != replica.epoch:  # lost while it loaded the adapter or fetched the prefix
                        self._lost(seq)
                        continue
                    replica.loading(-1)
                    if kind == _LOADED:
                        replica.load(seq.request.adapter)
                        self._deliver(seq, replica)
                    else:
                        self._queue(seq, replica)
                elif kind == _ARRIVE:
                    self._arrive(payload)
                elif kind == _FAULT:
                    self._fault(*payload)
                else:
                    call, args = payload
                    call(*args)
            else:
                self.now_s = pending.at_s
                self._arrive(pending)
                pending = next(arrivals, None)
        self.record.end_s = self.now_s
        if self.scaler is not None:
            self.scaler.finish()
        self.record.busy_s = [r.stats.busy_s for r in self.replicas]
        self.record.slot_s = [r.stats.slot_s for r in self.replicas]
        self.record.num_seq_slots = self.profile.engine.num_seq_slots
        self.record.num_adapter_evictions = sum(r.num_evictions for r in self.replicas)
        self.record.num_lower_loads = sum(r.lower_loads for r in self.replicas)
        for r in self.replicas:
            for bucket, count in r.stats.gaps.items():
                self.record.gaps[bucket] = self.record.gaps.get(bucket, 0) + count
        return self.record

    def _end(self, request: SimRequest, outcome: str) -> None:
        self.record.outcomes[outcome] += 1
        follower = self._parked.pop(request.index, None)
        if follower is not None:  # the pipeline's next call, sent now
            self._push(self.now_s, _ARRIVE, 0, replace(follower, at_s=self.now_s))
        if request.at_s >= self.scenario.warmup_s:
            per_tenant = self.record.measured.setdefault(request.tenant, dict.fromkeys(OUTCOMES, 0))
            per_tenant[outcome] += 1
        self._tried.pop(request.index, None)
        self.users.ended(request, outcome, self.now_s)

    def _arrive(self, request: SimRequest) -> None:
        if request.after >= 0 and request.after in self._tried:  # sent once the call it follows has ended
            self._parked[request.after] = request
            return
        if request.at_s >= self.scenario.warmup_s:
            self.record.num_measured += 1
        if self.cores is not None:
            self.cores.arrived(self.now_s)
        request = self.churn.current(request)
        if request.num_prompt_tokens + request.max_tokens > self.profile.slot_len:
            self._end(request, "failed_too_long")
            return
        tenant = self.tenants[request.tenant]
        try:
            run_sync(self.limiter.admit(tenant))
            run_sync(self.limiter.spend(tenant, request.num_prompt_tokens + request.max_tokens))
        except GatewayError as e:
            self._end(request, "refused_rate" if e.status == 429 else "failed_too_long")
            return
        self.churn.count(request.adapter)
        self._route(Seq(request, self.now_s), request_key(request, self.scenario.chunk_tokens))

    def _fault(self, fault: Fault, starting: bool) -> None:
        if fault.kind == "redis_down":
            if self.shared is not None:
                self.shared.is_down = starting
            return
        if fault.kind == "redis_slow":
            self.redis_latency_s = fault.latency_s if starting else 0.0
            return
        n = len(self.replicas)
        for index in sorted({int(k * n / fault.replicas) for k in range(min(fault.replicas, n))}):  # spread over the fleet
            replica = self.replicas[index]
            if starting and not replica.is_down:
                self.down.add(index)
                for seq in replica.lose():
                    self._lost(seq)
            elif not starting and replica.is_down:
                self.down.discard(index)
                replica.restart()

    def _lost(self, seq: Seq) -> None:
        """Its replica is gone: a begun stream fails, a request tried fewer than max_attempts times starts again elsewhere."""
        request = seq.request
        self.record.num_lost += 1
        is_stream = (request.index * 2654435761) % (1 << 32) < self.fleet.sim.stream_share * (1 << 32)
        if (is_stream and seq.first_token_s >= 0) or len(self._tried.get(request.index, ())) >= self.routing.max_attempts:
            self._end(request, "failed_replica_lost")
            return
        self.record.num_lost_retried += 1
        self._route(Seq(request, self.now_s))

    def _route(self, seq: Seq, key: bytes | None = None) -> None:
        request = seq.request
        tried = self._tried.setdefault(request.index, [])
        excluded = tried if not self.down else self.down.union(tried)  # a lost replica: known gone, as a failed channel says
        try:
            index = self.router.route(request, key or request_key(request, self.scenario.chunk_tokens), excluded)
        except ReplicasBusy:
            self._end(request, "refused_busy")
            return
        except NoCandidateError:
            self._end(request, "refused_busy" if tried else "failed_no_replica")
            return
        tried.append(index)
        replica = self.replicas[index]
        if not replica.holds(request.adapter):
            replica.loading(1)
            self.record.num_adapter_loads += 1
            self.record.load_times_s.append(self.now_s)
            self._push(self.now_s + replica.load_s(request.adapter), _LOADED, index, (seq, replica.epoch))
            return
        replica.load(request.adapter)  # used: most recently
        self._deliver(seq, replica)

    def _deliver(self, seq: Seq, replica: ReplicaModel) -> None:
        seq.arrived_s = self.now_s
        if self.cores is not None:
            self.cores.reached(self.now_s, replica.index)
        fetch_token_s = self.profile.l2_fetch_token_s
        if fetch_token_s is not None and self.shared is not None:  # looked up on arrival, off the step loop
            request = seq.request
            own = replica.cache.lookup(request)
            tier = 0 if self.shared.is_down else self.shared.lookup(request)
            seq.num_cached, seq.looked_up = min(max(own, tier), seq.num_prompt - 1), True
            if tier > own:
                replica.cache.store(request)  # the fetched chunks: in its L1 from now on
                self.record.fetched_tokens += tier - own
            wait_s = 0.0 if self.shared.is_down else (self.profile.l2_lookup_s + self.redis_latency_s
                                                      + max(0, tier - own) * fetch_token_s)
            if wait_s > 0:
                replica.loading(1)  # in flight there, not queued yet
                self._push(self.now_s + wait_s, _FETCHED, replica.index, (seq, replica.epoch))
                return
        self._queue(seq, replica)

    def _queue(self, seq: Seq, replica: ReplicaModel) -> None:
        if not replica.offer(seq):  # 503: its queue is full
            if len(self._tried[seq.request.index]) < self.routing.max_attempts:
                self._route(seq)
            else:
                self._end(seq.request, "refused_busy")
            return
        if replica.is_idle:
            end_s = replica.start(self.now_s)
        else:
            end_s = replica.cut(self.now_s)
        if end_s is not None:
            self._push(end_s, _STEP, replica.index, replica.version)

    def _step_end(self, replica: ReplicaModel, version: int) -> None:
        if version != replica.version:
            return  # a run cut short: its new end is queued
        for seq in replica.finish_steps(self.now_s):
            self._complete(seq)
        end_s = replica.start(self.now_s)
        if end_s is not None:
            self._push(end_s, _STEP, replica.index, replica.version)

    def _complete(self, seq: Seq) -> None:
        request = seq.request
        self._end(request, "completed")
        if request.at_s < self.scenario.warmup_s:
            return
        r = self.record
        r.ttft_s.append(seq.first_token_s - request.at_s + self.profile.hop_s)
        r.tenants.append(request.tenant)
        r.arrivals.append(request.at_s)
        if request.max_tokens > 1:
            r.itl_s.append((seq.finished_s - seq.first_token_s) / (request.max_tokens - 1))
        r.queue_s.append(seq.admitted_s - seq.arrived_s)
        r.prompt_tokens += seq.num_prompt
        r.cached_tokens += seq.num_cached
