"""The request path between HTTP and the shard replicas (torch-free): a `Gateway` admits a
tenant's request (gateway/admission.py), routes it to a replica that holds its adapters
(gateway/policy/routing.py), runs it there and fails over to another replica when one
dies before answering; and it asks every replica for its health and metrics.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from dataclasses import replace
from typing import Any

from gateway.admission import Admission, Prepared
from gateway.api.protocol import APIError
from gateway.catalog import Catalog
from gateway.config import ServeConfig
from gateway.metrics import GatewayMetrics, merge_worker_metrics
from gateway.policy.routing import NoCandidateError, RecentLoad, ReplicasBusy, ReplicaView, candidates, choose
from gateway.pool import ShardPool, WorkerFailed
from gateway.ratelimit import RateLimiter
from gateway.registry.registry import AdapterRegistry, open_registry
from gateway.tenants import Tenants
from worker.contract.calls import Delta, WorkerCall

log = logging.getLogger(__name__)
FAILED_REPLICA_COOLDOWN_S = 5.0
HEALTH_TIMEOUT_S = 2.0
MAX_ATTEMPTS = 2  # replicas a request may be tried on: one failover, so one poison request cannot take down them all
BUSY_RETRY_AFTER_S = "1"
WORKER_GRACE_S = 5.0  # past the worker's own deadline, the gateway stops waiting for it


class Gateway:
    def __init__(self, config: ServeConfig, catalog: Catalog, pool: ShardPool, limiter: RateLimiter | None = None,
                 metrics: GatewayMetrics | None = None, clock: Callable[[], float] = time.monotonic, registry: AdapterRegistry | None = None) -> None:
        self.config, self.catalog, self.pool = config, catalog, pool
        self.tenants = Tenants(config)
        self.limiter = limiter or RateLimiter()
        self.registry = registry or open_registry(config, catalog, pool)
        self.admission = Admission(config, catalog, self.limiter, self.registry, clock)
        self.metrics = metrics or GatewayMetrics()
        self._clock = clock
        self._in_flight: dict[str, int] = {}
        self._failed_until: dict[str, float] = {}
        self._recent = RecentLoad()

    # routing and running

    def views(self) -> list[ReplicaView]:
        now = self._clock()
        engine = self.config.engine
        return [
            ReplicaView(r.replica_id, r.shard, self.registry.held[r.replica_id], self._in_flight.get(r.replica_id, 0), self._failed_until.get(r.replica_id, 0.0) <= now,
                        self._recent.get(r.replica_id, now), engine.num_slots, engine.num_slots + engine.max_waiting)
            for r in self.pool.replicas
        ]

    def _attempt(self, prepared: Prepared, tried: set[str]) -> ReplicaView:
        """Choose a replica not tried yet for this request and count it busy (503 when none is left)."""
        try:
            pool = candidates(self.views(), prepared.adapters, exclude=tried, labels=prepared.labels)
        except ReplicasBusy as e:
            raise APIError(503, str(e), "replicas_busy", {"Retry-After": BUSY_RETRY_AFTER_S}) from e
        except NoCandidateError as e:
            raise APIError(503, str(e), "no_healthy_worker", {"Retry-After": BUSY_RETRY_AFTER_S}) from e
        replica = choose(pool, prepared.affinity, self.config.routing, shared_cache=bool(self.config.cache.redis_url))
        self.metrics.route(replica.shard, replica.replica_id, self.config.routing)
        if not tried:
            self.registry.count(prepared.adapters)
        tried.add(replica.replica_id)
        self._recent.add(replica.replica_id, self._clock())
        prepared.route = {"replica": replica.replica_id, "shard": replica.shard}
        self._in_flight[replica.replica_id] = self._in_flight.get(replica.replica_id, 0) + 1
        return replica

    def _next(self, prepared: Prepared, tried: set[str], busy: Delta | None) -> ReplicaView:
        """The next replica to try; when none is left after a full one refused, that refusal."""
        try:
            return self._attempt(prepared, tried)
        except APIError:
            if busy is not None:
                raise self.error_of(busy, prepared) from None
            raise

    def _failed(self, replica: ReplicaView, error: Exception, what_next: str) -> None:
        """The replica itself failed (it died or could not be reached): down for a while."""
        self._failed_until[replica.replica_id] = self._clock() + FAILED_REPLICA_COOLDOWN_S
        self.metrics.replica_failure(replica.replica_id)
        log.warning("replica %s failed (%s)%s", replica.replica_id, error, what_next)

    def error_of(self, delta: Delta, prepared: Prepared) -> APIError:
        """The client's error for a worker's error delta. A 4xx is the request's fault and says
        why; a 5xx says nothing internal (the detail goes to the log)."""
        status = delta.status or 500
        if status < 500:
            return APIError(status, delta.error or "bad request", "invalid_request")
        log.warning("request %s on %s: %s (%d)", prepared.call.request_id, prepared.route.get("replica"), delta.error, status)
        if status == 503:
            return APIError(503, delta.error or "the worker is busy", "worker_busy", {"Retry-After": BUSY_RETRY_AFTER_S})
        if status in (502, 504):  # the gateway's own words, or the deadline's
            return APIError(status, delta.error or "the worker failed", "timeout" if status == 504 else "worker_failed")
        return APIError(status, "the worker failed to complete the request", "worker_error")

    def _call(self, prepared: Prepared) -> WorkerCall:
        """The call with what is left of the request's deadline."""
        left = prepared.call.timeout_s - (self._clock() - prepared.admitted_s) if prepared.call.timeout_s is not None else None
        if left is not None and left <= 0:
            raise APIError(503, f"the request waited past its deadline of {prepared.call.timeout_s:g} s", "timeout",
                           {"Retry-After": BUSY_RETRY_AFTER_S})
        return replace(prepared.call, timeout_s=left)

    def _deadline(self, call: WorkerCall) -> float | None:
        """When (event-loop time) the gateway stops waiting for the worker: a little past the worker's own deadline."""
        return None if call.timeout_s is None else asyncio.get_running_loop().time() + call.timeout_s + WORKER_GRACE_S

    async def stream(self, prepared: Prepared) -> AsyncIterator[Delta]:
        """The worker's deltas. Before the first one, a replica that fails is marked down and the
        request goes to another (once), as it does when a replica refuses it as too busy; a
        refusal for the request's own sake is its APIError, never retried. After the first,
        a failure ends the stream with an error delta."""
        tried: set[str] = set()
        busy: Delta | None = None  # the last refusal of a full replica
        while True:
            call = self._call(prepared)
            replica = self._next(prepared, tried, busy)
            started = False
            try:
                async with aclosing(_until(self.pool.stream(replica.replica_id, call), self._deadline(call))) as deltas:
                    async for delta in deltas:
                        if not started and delta.status is not None:  # nothing ran
                            if delta.status == 503 and len(tried) < MAX_ATTEMPTS:
                                busy = delta
                                break  # that replica is full: another may not be
                            raise self.error_of(delta, prepared)
                        started = True
                        yield delta
                    else:
                        return
            except WorkerFailed as e:
                self._failed(replica, e, "" if started else "; retrying elsewhere")
                if started:
                    yield Delta.failed("the worker failed mid-stream", status=502)
                    return
                if len(tried) >= MAX_ATTEMPTS:
                    raise APIError(503, "the workers failed to take the request", "worker_failed", {"Retry-After": BUSY_RETRY_AFTER_S}) from e
            except TimeoutError as e:
                self._failed(replica, e, "; it did not answer within the request's deadline")
                if started:
                    yield Delta.failed("the request did not finish within its deadline", status=504)
                    return
                raise APIError(504, "the request did not finish within its deadline", "timeout") from e
            finally:
                self._in_flight[replica.replica_id] -= 1

    async def collect(self, prepared: Prepared, on_first: Callable[[], None] | None = None) -> list[Delta]:
        """All deltas of a non-streamed request (`on_first` when the first arrives). Nothing has
        reached the client yet, so a replica failing at any point sends the whole request to
        another (once); an error delta is the request's APIError."""
        tried: set[str] = set()
        busy: Delta | None = None
        while True:
            call = self._call(prepared)
            replica = self._next(prepared, tried, busy)
            deltas: list[Delta] = []
            try:
                async with aclosing(_until(self.pool.stream(replica.replica_id, call), self._deadline(call))) as stream:
                    async for delta in stream:
                        if not deltas:
                            if delta.status == 503 and len(tried) < MAX_ATTEMPTS:
                                busy = delta
                                break  # that replica is full: another may not be
                            if on_first is not None:
                                on_first()
                        deltas.append(delta)
                    else:
                        if deltas[-1].finish_reason == "error":
                            raise self.error_of(deltas[-1], prepared)
                        return deltas
            except WorkerFailed as e:
                self._failed(replica, e, "; retrying the whole request elsewhere")
                if len(tried) >= MAX_ATTEMPTS:
                    raise APIError(503, "the workers failed to run the request", "worker_failed", {"Retry-After": BUSY_RETRY_AFTER_S}) from e
            except TimeoutError as e:
                self._failed(replica, e, "; it did not answer within the request's deadline")
                raise APIError(504, "the request did not finish within its deadline", "timeout") from e
            finally:
                self._in_flight[replica.replica_id] -= 1

    async def full_health(self) -> dict[str, Any]:
        """Per shard and replica (asking every worker at once, within a timeout), and the
        cache's Redis state.

        status: ok; degraded (a replica down, or Redis down: requests run uncached); down (a
        shard has no healthy replica: some requests cannot be served).
        """
        views = self.views()
        answers = await asyncio.gather(*(_within(self.pool.health(v.replica_id)) for v in views), return_exceptions=True)
        shards: dict[str, dict[str, Any]] = {}
        redis_states = set()
        for view, answer in zip(views, answers):
            entry = shards.setdefault(view.shard, {"replicas": [], "healthy": 0})
            report: dict[str, Any] = {"id": view.replica_id, "in_flight": view.in_flight}
            if isinstance(answer, BaseException):  # unreachable, dead, or too slow to answer: down
                report.update(healthy=False, error=type(answer).__name__)
            else:
                report.update(healthy=view.is_healthy, cache=answer.get("cache", {}), pid=answer.get("pid"),  # for operators only
                              adapters=len(answer.get("adapters", ())), memory=answer.get("memory", {}))
                redis_states.add(report["cache"].get("redis", "off"))
            entry["replicas"].append(report)
            entry["healthy"] += report["healthy"]
        redis = "degraded" if "degraded" in redis_states else "ok" if "ok" in redis_states else "off"
        if not all(s["healthy"] for s in shards.values()):
            status = "down"
        elif any(s["healthy"] < len(s["replicas"]) for s in shards.values()) or redis == "degraded":
            status = "degraded"
        else:
            status = "ok"
        return {"status": status, "redis": redis, "shards": shards, "registry": self.registry.health()}

    async def full_metrics(self) -> str:
        """The gateway's metrics and every replica's (asked all at once, within a timeout)."""
        replicas = self.pool.replicas
        answers = await asyncio.gather(*(_within(self.pool.metrics(r.replica_id)) for r in replicas), return_exceptions=True)
        texts = {}
        for replica, answer in zip(replicas, answers):
            if isinstance(answer, BaseException):  # a replica that cannot answer leaves its series out
                log.warning("metrics: replica %s did not answer (%s)", replica.replica_id, answer)
            else:
                texts[replica.replica_id] = answer
        return self.metrics.render() + merge_worker_metrics(texts)


async def _within(awaitable, timeout_s: float = HEALTH_TIMEOUT_S):
    return await asyncio.wait_for(awaitable, timeout_s)


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
