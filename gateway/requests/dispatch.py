"""The request path between HTTP and the shard replicas (torch-free): once a request is admitted
(gateway/requests/admission.py), the `Dispatcher` routes it to a replica that holds its adapters
(gateway/policy/routing/), runs it there and fails over to another replica when one dies before
answering; and it asks every replica for its health and metrics. Its tunables are the config's
`routing` (RoutingSettings).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from contextlib import aclosing
from dataclasses import replace
from typing import Any, TypeVar

from opentelemetry.trace import Tracer

from gateway.cluster.membership import UP
from gateway.cluster.pool import ShardPool, WorkerFailed
from gateway.config import ServeConfig
from gateway.errors import GatewayError
from gateway.metrics import GatewayMetrics, adapter_label, merge_worker_metrics
from gateway.policy.routing import NoCandidateError, NoneReachable, RecentLoad, ReplicasBusy, ReplicaView, candidates, choose
from gateway.registry.registry import AdapterRegistry
from gateway.requests.admission import Prepared
from gateway.requests.tracing import Attempt, RequestSpans
from worker.contract.calls import Delta, WorkerCall

log = logging.getLogger(__name__)
T = TypeVar("T")
REACHABLE_POLL_S = 0.1  # how often a request that found no replica reachable looks again


class Dispatcher:
    """Routes admitted requests to replicas and runs them there, failing over; asks every replica
    for its health and metrics."""

    def __init__(self, config: ServeConfig, pool: ShardPool, registry: AdapterRegistry, metrics: GatewayMetrics,
                 tracer: Tracer, clock: Callable[[], float] = time.monotonic) -> None:
        self.config, self.pool, self.registry, self.metrics, self.tracer = config, pool, registry, metrics, tracer
        self.routing = config.routing
        self._clock = clock
        self._in_flight: dict[str, int] = {}
        self._failed_until_s: dict[str, float] = {}
        self._recent = RecentLoad(self.routing.half_life_s)

    # routing and running

    def views(self) -> list[ReplicaView]:
        now_s = self._clock()
        num_seq_slots = self.config.engine.num_seq_slots
        is_reachable = getattr(self.pool, "is_reachable", lambda _: True)
        replicas = self.pool.replicas
        recent = self._recent.get_many([r.replica_id for r in replicas], now_s)
        return [
            ReplicaView(r.replica_id, r.shard, self.registry.held[r.replica_id],
                        in_flight=self._in_flight.get(r.replica_id, 0),
                        is_healthy=self._failed_until_s.get(r.replica_id, 0.0) <= now_s, is_reachable=is_reachable(r.replica_id),
                        recent=load, num_seq_slots=num_seq_slots,
                        capacity=num_seq_slots + self.config.engine.max_waiting, tiers=self.registry.tiers.get(r.replica_id))
            for r, load in zip(replicas, recent)
        ]

    def _retry_after(self) -> dict[str, str]:
        return {"Retry-After": str(self.routing.busy_retry_after_s)}

    def _route(self, prepared: Prepared, tried: set[str], busy: Delta | None, may_wait: bool = False) -> ReplicaView:
        """A replica not tried yet for this request, counted in flight. When none is left: the
        last refusal of a full replica (`busy`) if there was one, else a 503; with `may_wait`,
        NoneReachable as it is when replicas are there but none is reachable now."""
        try:
            pool = candidates(self.views(), prepared.scales_by_fingerprint, exclude=tried,
                              names=prepared.names_by_fingerprint)
        except NoCandidateError as e:
            if may_wait and isinstance(e, NoneReachable):
                raise
            if busy is not None:
                raise self.error_of(busy, prepared) from None
            code = "replicas_busy" if isinstance(e, ReplicasBusy) else "no_healthy_worker"
            raise GatewayError(503, str(e), code, self._retry_after()) from e
        fingerprints = prepared.scales_by_fingerprint
        replica = choose(pool, prepared.affinity, self.routing, shared_cache=self.config.cache.redis is not None,
                         fingerprints=fingerprints)
        self.metrics.route(replica.shard, replica.replica_id, self.routing.policy, replica.tier(fingerprints))
        self.registry.promoted(replica.replica_id, fingerprints)
        if not tried:
            self.registry.count(prepared.scales_by_fingerprint)
        tried.add(replica.replica_id)
        self._recent.add(replica.replica_id, self._clock())
        prepared.route = {"replica": replica.replica_id, "shard": replica.shard}
        self._in_flight[replica.replica_id] = self._in_flight.get(replica.replica_id, 0) + 1
        return replica

    def _failed(self, replica: ReplicaView, error: Exception, what_next: str) -> None:
        """The replica itself failed (it died or could not be reached): down for a while."""
        self._failed_until_s[replica.replica_id] = self._clock() + self.routing.failed_cooldown_s
        self.metrics.replica_failure(replica.replica_id)
        log.warning("replica %s failed (%s)%s", replica.replica_id, error, what_next)

    def error_of(self, delta: Delta, prepared: Prepared) -> GatewayError:
        """The client's error for a worker's error delta. A 4xx is the request's fault and says
        why; a 5xx says nothing internal (the detail goes to the log)."""
        status = delta.status or 500
        if status < 500:
            return GatewayError(status, delta.error or "bad request", "invalid_request")
        log.warning("request %s on %s: %s (%d)", prepared.call.request_id, prepared.route.get("replica"),
                    delta.error, status)
        if status == 503:
            return GatewayError(503, delta.error or "the worker is busy", "worker_busy", self._retry_after())
        if status in (502, 504):  # the gateway's own words, or the deadline's
            code = "timeout" if status == 504 else "worker_failed"
            return GatewayError(status, delta.error or "the worker failed", code)
        return GatewayError(status, "the worker failed to complete the request", "worker_error")

    def _call(self, prepared: Prepared) -> WorkerCall:
        """The call with what is left of the request's deadline."""
        timeout_s = prepared.call.timeout_s
        if timeout_s is None:
            return prepared.call
        left_s = timeout_s - (self._clock() - prepared.admitted_s)
        if left_s <= 0:
            raise GatewayError(503, f"the request waited past its deadline of {timeout_s:g} s", "timeout",
                           self._retry_after())
        return replace(prepared.call, timeout_s=left_s)

    async def _until_reachable(self, prepared: Prepared, tried: set[str], left_s: float | None) -> None:
        """Wait, up to `unresponsive_after_s` and within what is left of the request's deadline, for
        a replica that may take it to be reachable again (one that went silent under a burst of load
        is heard from again as soon as it answers a new channel): better late than refused. Where the
        replicas that may take it are asleep or starting (an autoscaled shard), the pool wakes them and
        says how long a start may take: the wait is that long, and the answer says what it waited
        (`Prepared.cold_start_s`)."""
        loop = asyncio.get_running_loop()
        holding = [v.replica_id for v in self.views() if frozenset(prepared.scales_by_fingerprint) <= v.fingerprints]
        starting_s = getattr(self.pool, "wake", lambda _: None)(holding)
        wait_s = self.routing.unresponsive_after_s if starting_s is None else max(starting_s, self.routing.unresponsive_after_s)
        wait_s = wait_s if left_s is None else min(wait_s, left_s)
        started = loop.time()
        until = started + wait_s
        try:
            while loop.time() < until:
                await asyncio.sleep(REACHABLE_POLL_S)
                try:
                    candidates(self.views(), prepared.scales_by_fingerprint, exclude=tried)
                    return
                except NoneReachable:
                    continue
                except NoCandidateError:
                    return
        finally:
            if starting_s is not None:
                prepared.cold_start_s += loop.time() - started

    def _deadline(self, call: WorkerCall) -> float | None:
        """When (event-loop time) the gateway stops waiting for the worker: a little past the worker's own deadline."""
        if call.timeout_s is None:
            return None
        return asyncio.get_running_loop().time() + call.timeout_s + self.routing.worker_grace_s

    async def _attempts(self, prepared: Prepared, is_streamed: bool,
                        on_first: Callable[[], None] | None = None) -> AsyncIterator[Delta]:
        """The request's deltas from one replica after another, until one runs it (at most
        `max_attempts`). A replica refusing it as too busy, or failing before any delta reached
        the client, sends it to the next; a refusal for the request's own sake is its GatewayError,
        never retried. Streamed, each delta goes out as it comes, so once one has, a failure
        ends the stream with an error delta; whole, the deltas go out once the worker finished,
        so it fails over at any point. `on_first` when an attempt's first delta is taken."""
        max_attempts = self.routing.max_attempts
        tried: set[str] = set()
        busy: Delta | None = None  # the last refusal of a full replica
        has_waited = False
        spans = RequestSpans(self.tracer, prepared, self.routing.policy)
        adapter = adapter_label(prepared.names_by_fingerprint.values())
        while True:
            call = self._call(prepared)
            try:
                replica = self._route(prepared, tried, busy, may_wait=not has_waited)
            except NoneReachable:
                has_waited = True
                await self._until_reachable(prepared, tried, call.timeout_s)
                continue
            attempt = spans.attempt(replica, call)  # its call carries the attempt's trace context
            is_first, is_delivered = True, False
            whole: list[Delta] = []
            try:
                async with aclosing(_until(self.pool.stream(replica.replica_id, attempt.call), self._deadline(call))) as deltas:
                    async for delta in deltas:
                        prepared.num_generated_tokens += len(delta.token_ids)
                        if prepared.cold_start_s and delta.is_finished:  # its wait for a replica's start is its queue's
                            delta = replace(delta, queue_time_s=delta.queue_time_s + prepared.cold_start_s,
                                            prompt_time_s=delta.prompt_time_s + prepared.cold_start_s)
                        if delta.finish_reason is not None:
                            self.metrics.choice_finished(prepared.tenant.id, adapter, delta)
                        if is_first:
                            is_first = False
                            if self._is_full(attempt, delta, prepared, tried, on_first):
                                busy = delta
                                break  # that replica is full: another may not be
                        if is_streamed:
                            is_delivered = True
                            yield delta
                        else:
                            whole.append(delta)
                    else:
                        for delta in whole:
                            yield delta
                        return
            except WorkerFailed as e:
                last = self._worker_failed(replica, attempt, e, is_delivered, len(tried) < max_attempts, is_streamed)
                if last is not None:
                    yield last
                    return
            except TimeoutError as e:
                yield self._timed_out(replica, attempt, e, is_delivered, whole)
                return
            finally:
                self._in_flight[replica.replica_id] -= 1
                attempt.end()

    def _is_full(self, attempt: Attempt, first: Delta, prepared: Prepared, tried: set[str],
                 on_first: Callable[[], None] | None) -> bool:
        """Whether an attempt's first delta says its replica is full (and another may be tried); a
        refusal for the request's own sake, or a request ended at once (by its deadline: it ran), is
        its GatewayError."""
        attempt.answered(first)
        if first.status == 503 and len(tried) < self.routing.max_attempts:
            return True
        if on_first is not None:
            on_first()
        if first.status is not None:
            raise _with_usage(self.error_of(first, prepared), [first])
        return False

    def _worker_failed(self, replica: ReplicaView, attempt: Attempt, e: WorkerFailed, is_delivered: bool,
                       may_retry: bool, is_streamed: bool) -> Delta | None:
        """After a replica failed: the stream's last (error) delta once some went out; None to try
        the next replica; or the request's 503 when none is left to try."""
        attempt.failed(e)
        is_retried = not is_delivered and may_retry
        self._failed(replica, e, "; retrying elsewhere" if is_retried else "")
        if is_delivered:
            return Delta.failed("the worker failed mid-stream", status=502)
        if not is_retried:
            what = "take" if is_streamed else "run"
            raise GatewayError(503, f"the workers failed to {what} the request", "worker_failed", self._retry_after()) from e
        return None

    def _timed_out(self, replica: ReplicaView, attempt: Attempt, e: TimeoutError, is_delivered: bool,
                   whole: list[Delta]) -> Delta:
        """After the request's deadline passed: the stream's last (error) delta once some went out,
        else its 504 (it ran: its usage counts)."""
        attempt.failed(e)
        self._failed(replica, e, "; it did not answer within the request's deadline")
        if is_delivered:
            return Delta.failed("the request did not finish within its deadline", status=504)
        error = GatewayError(504, "the request did not finish within its deadline", "timeout")
        error.num_generated_tokens = sum(len(d.token_ids) for d in whole)
        raise error from e

    def stream(self, prepared: Prepared) -> AsyncIterator[Delta]:
        """The worker's deltas as they come (`_attempts`): it fails over only before the first."""
        return self._attempts(prepared, is_streamed=True)

    async def collect(self, prepared: Prepared, on_first: Callable[[], None] | None = None) -> list[Delta]:
        """All deltas of a non-streamed request (`on_first` when the first arrives). Nothing has
        reached the client yet, so it fails over at any point (`_attempts`); an error delta is
        the request's GatewayError."""
        deltas = [delta async for delta in self._attempts(prepared, is_streamed=False, on_first=on_first)]
        if deltas[-1].finish_reason == "error":
            raise _with_usage(self.error_of(deltas[-1], prepared), deltas)
        return deltas

    async def replica_health(self) -> tuple[dict[str, dict[str, Any]], str]:
        """Per shard, its replicas' reports (asking every worker at once, within a timeout), and the
        cache's Redis state over them (ok, degraded, off)."""
        views = self.views()
        phase_of = getattr(self.pool, "phase", lambda _: UP)  # an autoscaled shard's replicas: up, starting, draining, asleep
        phases = [phase_of(v.replica_id) for v in views]
        answers = iter(await self._ask_all(self.pool.health(v.replica_id) for v, phase in zip(views, phases) if phase == UP))
        shards: dict[str, dict[str, Any]] = {}
        redis_states = set()
        for view, phase in zip(views, phases):
            entry = shards.setdefault(view.shard, {"replicas": [], "healthy": 0})
            report: dict[str, Any] = {"id": view.replica_id, "in_flight": view.in_flight}
            if phase != UP:  # not asked: it does not serve now, by Serve's autoscaling
                report.update(healthy=False, phase=phase)
                entry["replicas"].append(report)
                continue
            answer = next(answers)
            if isinstance(answer, BaseException):  # unreachable, dead, or too slow to answer: down
                report.update(healthy=False, error=type(answer).__name__)
            else:
                report.update(healthy=view.is_healthy and view.is_reachable, cache=answer.get("cache", {}),
                              pid=answer.get("pid"), node=answer.get("node"),  # for operators only; node: Ray's id and IP
                              adapters=len(answer.get("adapters", ())), memory=answer.get("memory", {}),
                              requests=answer.get("requests", {}))  # the engine's: running and waiting
                redis_states.add(report["cache"].get("redis", "off"))
            entry["replicas"].append(report)
            entry["healthy"] += report["healthy"]
        redis = "degraded" if "degraded" in redis_states else "ok" if "ok" in redis_states else "off"
        return shards, redis

    async def full_metrics(self) -> str:
        """The gateway's metrics and every serving replica's (asked all at once, within a timeout; an
        autoscaled shard's replicas that Serve keeps starting, draining or asleep are not asked)."""
        phase_of = getattr(self.pool, "phase", lambda _: UP)
        replicas = [r for r in self.pool.replicas if phase_of(r.replica_id) == UP]
        answers = await self._ask_all(self.pool.metrics(r.replica_id) for r in replicas)
        texts = {}
        for replica, answer in zip(replicas, answers):
            if isinstance(answer, BaseException):  # a replica that cannot answer leaves its series out
                log.warning("metrics: replica %s did not answer (%s)", replica.replica_id, answer)
            else:
                texts[replica.replica_id] = answer
        return self.metrics.render() + merge_worker_metrics(texts)

    async def _ask_all(self, questions: Iterable[Awaitable[T]]) -> list[T | BaseException]:
        """Every replica's answer, asked all at once; an exception for one that fails or takes
        longer than `health_timeout_s`."""
        timeout_s = self.routing.health_timeout_s
        return await asyncio.gather(*(asyncio.wait_for(q, timeout_s) for q in questions), return_exceptions=True)


def _with_usage(error: GatewayError, deltas: list[Delta]) -> GatewayError:
    """`error`, saying what its request generated when it ran before it failed (the worker ended it at its
    deadline, or after tokens): its usage counts."""
    generated = sum(len(d.token_ids) for d in deltas)
    if generated or error.status == 504:
        error.num_generated_tokens = generated
    return error


async def _until(deltas: AsyncIterator[Delta], deadline: float | None) -> AsyncIterator[Delta]:
    """`deltas` until `deadline` (event-loop time; TimeoutError when the next one is late).
    Closing this closes `deltas` too, which cancels the worker's request."""
    try:
        while True:
            try:
                async with asyncio.timeout_at(deadline):
                    delta = await anext(deltas)
            except StopAsyncIteration:
                return
            yield delta
    finally:
        await deltas.aclose()
