"""The gateway's logic between HTTP and the shards (torch-free): resolve the model
and adapters a tenant asks for, check the request, rate-limit it, route it, and
run it on a replica with failover.

A shard pool is anything with `replicas` (ReplicaInfo) and
`stream(replica_id, call)` (an async iterator of the worker's deltas); Ray
Serve handles in production (gateway/serve.py), in-process workers in tests.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from gateway.catalog import Catalog
from gateway.config import ServeConfig
from gateway.metrics import GatewayMetrics
from gateway.protocol import APIError, LoraEntry
from gateway.ratelimit import RateLimiter
from gateway.routing import NoCandidateError, RecentLoad, ReplicaView, affinity_key, candidates, choose
from gateway.metrics import merge_worker_metrics
from gateway.tenants import Tenant, Tenants
from worker.engine.params import SamplingParams

log = logging.getLogger(__name__)
FAILED_REPLICA_COOLDOWN_S = 5.0
HEALTH_TIMEOUT_S = 2.0


@dataclass(frozen=True)
class ReplicaInfo:
    replica_id: str
    shard: str
    adapters: frozenset[str]


def replica_infos(config: ServeConfig) -> list[ReplicaInfo]:
    """Every replica of every shard, named `<shard>-<i>` (the Serve deployment is `shard-<shard>-<i>`)."""
    return [ReplicaInfo(f"{s.name}-{i}", s.name, frozenset(s.adapters)) for s in config.shards for i in range(s.replicas)]


class ShardPool(Protocol):
    replicas: list[ReplicaInfo]

    def stream(self, replica_id: str, call: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        """The worker's deltas; WorkerFailed when the replica cannot be reached or dies."""

    async def health(self, replica_id: str) -> dict[str, Any]: ...

    async def metrics(self, replica_id: str) -> str: ...


class WorkerFailed(RuntimeError):
    """The replica died or could not be reached (as opposed to a request it refused)."""


@dataclass
class Prepared:
    """A checked request, ready to route."""

    call: dict[str, Any]  # what the worker gets (plain data)
    tenant: Tenant
    scales: dict[str, float]  # adapter name -> scale, non-zero
    affinity: bytes
    num_prompt_tokens: int
    route: dict[str, str] = field(default_factory=dict)  # filled once routed: replica, shard


class Gateway:
    def __init__(self, config: ServeConfig, catalog: Catalog, pool: ShardPool, limiter: RateLimiter | None = None,
                 metrics: GatewayMetrics | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.config, self.catalog, self.pool = config, catalog, pool
        self.tenants = Tenants(config)
        self.limiter = limiter or RateLimiter()
        self.metrics = metrics or GatewayMetrics()
        self._clock = clock
        self._in_flight: dict[str, int] = {}
        self._failed_until: dict[str, float] = {}
        self._recent = RecentLoad()

    # resolving what was asked

    def adapter_names(self, tenant: Tenant) -> list[str]:
        """The adapters this tenant may use, in config order (the ids of /lora-adapters)."""
        return tenant.visible(list(self.catalog.adapters))

    def resolve_scales(self, tenant: Tenant, model: str | None, lora: list[LoraEntry] | None) -> dict[str, float]:
        visible = self.adapter_names(tenant)
        scales: dict[str, float] = {} if lora is not None else dict(tenant.default_scales)
        if model is not None and model != self.catalog.model_name:
            if model not in visible:
                raise APIError(404, f"model {model!r} not found", "model_not_found")
            scales[model] = 1.0
        for entry in lora or []:
            if entry.name is not None:
                if entry.name not in visible:
                    raise APIError(404, f"adapter {entry.name!r} not found", "adapter_not_found")
                name = entry.name
            else:
                if entry.id >= len(visible):
                    raise APIError(404, f"adapter id {entry.id} not found (this key has {len(visible)} adapters)", "adapter_not_found")
                name = visible[entry.id]
            scales[name] = scales.get(name, 0.0) + entry.scale
        return self.enabled(scales)

    def enabled(self, scales: dict[str, float]) -> dict[str, float]:
        """The non-zero scales; 400 when they turn on more than one aLoRA (SPEC §4)."""
        scales = {n: s for n, s in scales.items() if s != 0.0}
        if sum(self.catalog.adapters[n].is_alora for n in scales) > 1:
            raise APIError(400, "Cannot run multiple aLoRAs in a single request", "multiple_aloras")
        return scales

    def prepare(self, tenant: Tenant, prompt_ids: list[int], params: SamplingParams, scales: dict[str, float],
                request_salt: str | None = None, cache_prompt: bool = True) -> Prepared:
        vocab = self.catalog.hparams.vocab_size
        bad = [t for t in prompt_ids if not 0 <= t < vocab]
        if bad:
            raise APIError(400, f"prompt token id {bad[0]} is out of range (vocabulary size {vocab})", "invalid_prompt")
        if not prompt_ids:
            raise APIError(400, "the prompt is empty", "invalid_prompt")
        limit = self.catalog.max_positions
        wanted = params.max_tokens if params.max_tokens != -1 else 0
        if len(prompt_ids) + wanted > limit or len(prompt_ids) >= limit:
            raise APIError(400, f"This model's maximum context length is {limit} tokens. However, you requested "
                           f"{len(prompt_ids) + wanted} tokens ({len(prompt_ids)} in the prompt, {wanted} for the completion).",
                           "context_length_exceeded")
        budget = len(prompt_ids) + (params.max_tokens if params.max_tokens != -1 else limit - len(prompt_ids))
        self.limiter.check(tenant, budget)
        # the affinity key uses the KV-relevant set: an aLoRA shares the base's prefix (SPEC §4)
        kv_scales = {n: s for n, s in scales.items() if not self.catalog.adapters[n].is_alora}
        key = affinity_key(self.catalog.adapter_set_fingerprint(kv_scales), prompt_ids, self.config.cache.chunk_tokens)
        call = {
            "request_id": uuid.uuid4().hex,
            "prompt_ids": list(prompt_ids),
            "params": {
                "max_tokens": params.max_tokens, "temperature": params.temperature, "top_p": params.top_p, "top_k": params.top_k,
                "seed": params.seed, "ignore_eos": params.ignore_eos, "logprobs": params.logprobs, "echo": params.echo,
                "stop": list(params.stop),
            },
            "adapters": scales,
            "cache_salt": tenant.cache_salt(request_salt),
            "cache_prompt": cache_prompt,
            "tenant": tenant.id,  # the worker shares its compute fairly between tenants
        }
        return Prepared(call, tenant, scales, key, len(prompt_ids))

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
    def _refused(delta: dict[str, Any]) -> None:
        """A first delta with a status: the worker refused the request (its fault, not the worker's)."""
        if delta.get("status"):
            raise APIError(int(delta["status"]), delta.get("error") or "bad request", "invalid_request")

    async def stream(self, prepared: Prepared) -> AsyncIterator[dict[str, Any]]:
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
                    yield {"token_ids": [], "text": "", "finish_reason": "error", "error": f"the worker failed mid-stream: {e}"}
                    return
            finally:
                self._in_flight[replica.replica_id] -= 1

    async def collect(self, prepared: Prepared) -> list[dict[str, Any]]:
        """All deltas of a non-streamed request. Nothing has reached the client yet, so a
        replica failing at any point sends the whole request to another."""
        tried: set[str] = set()
        while True:
            replica = self._attempt(prepared, tried)
            deltas: list[dict[str, Any]] = []
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
