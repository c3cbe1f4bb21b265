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
from typing import Any

from gateway.admission import Admission, Prepared
from gateway.api.protocol import APIError
from gateway.catalog import Catalog
from gateway.config import ServeConfig
from gateway.metrics import GatewayMetrics, merge_worker_metrics
from gateway.policy.routing import NoCandidateError, RecentLoad, ReplicaView, candidates, choose
from gateway.pool import ShardPool, WorkerFailed
from gateway.ratelimit import RateLimiter
from gateway.tenants import Tenants
from worker.contract.calls import Delta

log = logging.getLogger(__name__)
FAILED_REPLICA_COOLDOWN_S = 5.0
HEALTH_TIMEOUT_S = 2.0


class Gateway:
    def __init__(self, config: ServeConfig, catalog: Catalog, pool: ShardPool, limiter: RateLimiter | None = None,
                 metrics: GatewayMetrics | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.config, self.catalog, self.pool = config, catalog, pool
        self.tenants = Tenants(config)
        self.limiter = limiter or RateLimiter()
        self.admission = Admission(config, catalog, self.limiter)
        self.metrics = metrics or GatewayMetrics()
        self._clock = clock
        self._in_flight: dict[str, int] = {}
        self._failed_until: dict[str, float] = {}
        self._recent = RecentLoad()

    # routing and running

    def views(self) -> list[ReplicaView]:
        now = self._clock()
        return [
            ReplicaView(r.replica_id, r.shard, r.adapters, self._in_flight.get(r.replica_id, 0), self._failed_until.get(r.replica_id, 0.0) <= now,
                        self._recent.get(r.replica_id, now))
            for r in self.pool.replicas
        ]

    def _attempt(self, prepared: Prepared, tried: set[str]) -> ReplicaView:
        """Choose a replica not tried yet for this request and count it busy (503 when none is left)."""
        try:
            pool = candidates(self.views(), prepared.scales, exclude=tried)
        except NoCandidateError as e:
            raise APIError(503, str(e), "no_healthy_worker") from e
        replica = choose(pool, prepared.affinity, self.config.routing, shared_cache=bool(self.config.cache.redis_url))
        self.metrics.route(replica.shard, replica.replica_id, self.config.routing)
        tried.add(replica.replica_id)
        self._recent.add(replica.replica_id, self._clock())
        prepared.route = {"replica": replica.replica_id, "shard": replica.shard}
        self._in_flight[replica.replica_id] = self._in_flight.get(replica.replica_id, 0) + 1
        return replica

    def _failed(self, replica: ReplicaView, error: WorkerFailed, what_next: str) -> None:
        self._failed_until[replica.replica_id] = self._clock() + FAILED_REPLICA_COOLDOWN_S
        self.metrics.replica_failure(replica.replica_id)
        log.warning("replica %s failed (%s)%s", replica.replica_id, error, what_next)

    @staticmethod
    def _refused(delta: Delta) -> None:
        """A first delta with a status: the worker refused the request (its fault, not the worker's)."""
        if delta.status:
            raise APIError(delta.status, delta.error or "bad request", "invalid_request")

    async def stream(self, prepared: Prepared) -> AsyncIterator[Delta]:
        """The worker's deltas. A replica that fails before its first delta is marked down
        for a while and the request goes to another; after that, a final error delta."""
        tried: set[str] = set()
        while True:
            replica = self._attempt(prepared, tried)
            started = False
            try:
                async for delta in self.pool.stream(replica.replica_id, prepared.call):
                    if not started:
                        self._refused(delta)
                    started = True
                    yield delta
                return
            except WorkerFailed as e:
                self._failed(replica, e, "" if started else "; retrying elsewhere")
                if started:
                    yield Delta.failed(f"the worker failed mid-stream: {e}")
                    return
            finally:
                self._in_flight[replica.replica_id] -= 1

    async def collect(self, prepared: Prepared) -> list[Delta]:
        """All deltas of a non-streamed request. Nothing has reached the client yet, so a
        replica failing at any point sends the whole request to another."""
        tried: set[str] = set()
        while True:
            replica = self._attempt(prepared, tried)
            deltas: list[Delta] = []
            try:
                async for delta in self.pool.stream(replica.replica_id, prepared.call):
                    if not deltas:
                        self._refused(delta)
                    deltas.append(delta)
                return deltas
            except WorkerFailed as e:
                self._failed(replica, e, "; retrying the whole request elsewhere")
            finally:
                self._in_flight[replica.replica_id] -= 1

    async def full_health(self) -> dict[str, Any]:
        """Per shard and replica (asking each worker, within a timeout), and the cache's Redis state.

        status: ok; degraded (a replica down, or Redis down: requests run uncached); down (a
        shard has no healthy replica: some requests cannot be served).
        """
        shards: dict[str, dict[str, Any]] = {}
        redis_states = set()
        for view in self.views():
            entry = shards.setdefault(view.shard, {"replicas": [], "healthy": 0})
            report: dict[str, Any] = {"id": view.replica_id, "in_flight": view.in_flight}
            try:
                worker = await asyncio.wait_for(self.pool.health(view.replica_id), HEALTH_TIMEOUT_S)
                report["healthy"] = view.is_healthy
                report["cache"] = worker.get("cache", {})
                report["pid"] = worker.get("pid")
                redis_states.add(report["cache"].get("redis", "off"))
            except Exception as e:  # unreachable, dead, or too slow to answer: down
                report.update(healthy=False, error=f"{type(e).__name__}: {e}"[:200])
            entry["replicas"].append(report)
            entry["healthy"] += report["healthy"]
        redis = "degraded" if "degraded" in redis_states else "ok" if "ok" in redis_states else "off"
        if not all(s["healthy"] for s in shards.values()):
            status = "down"
        elif any(s["healthy"] < len(s["replicas"]) for s in shards.values()) or redis == "degraded":
            status = "degraded"
        else:
            status = "ok"
        return {"status": status, "redis": redis, "shards": shards}

    async def full_metrics(self) -> str:
        texts = {}
        for replica in self.pool.replicas:
            try:
                texts[replica.replica_id] = await asyncio.wait_for(self.pool.metrics(replica.replica_id), HEALTH_TIMEOUT_S)
            except Exception as e:  # a replica that cannot answer leaves its series out
                log.warning("metrics: replica %s did not answer (%s)", replica.replica_id, e)
        return self.metrics.render() + merge_worker_metrics(texts)
