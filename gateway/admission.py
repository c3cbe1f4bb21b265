"""What a tenant's request becomes before it is routed (torch-free): the adapters it names
resolved through the tenant's ACL, its numbers checked against the model, its cost
counted against the tenant's rate limits, and the `WorkerCall` a worker will run."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

from gateway.api.protocol import APIError, LoraEntry
from gateway.catalog import AdapterInfo, Catalog
from gateway.config import ServeConfig
from gateway.policy.routing import affinity_key
from gateway.ratelimit import RateLimiter
from gateway.registry.registry import AdapterRegistry
from gateway.tenants import Tenant
from worker.contract.calls import WorkerCall
from worker.contract.params import SamplingParams


@dataclass
class Prepared:
    """A checked request, ready to route."""

    call: WorkerCall
    tenant: Tenant
    scales: dict[str, float]  # adapter name (as the tenant knows it) -> scale, non-zero
    adapters: dict[str, float]  # adapter fingerprint -> scale, non-zero: what the worker runs and routing matches
    labels: dict[str, str]  # fingerprint -> the tenant's name for it (errors)
    affinity: bytes
    num_prompt_tokens: int
    admitted_s: float  # when it was admitted, on the gateway's clock (its deadline counts from here)
    route: dict[str, str] = field(default_factory=dict)  # filled once routed: replica, shard


class Admission:
    def __init__(self, config: ServeConfig, catalog: Catalog, limiter: RateLimiter, registry: AdapterRegistry,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.config, self.catalog, self.limiter, self.registry, self.clock = config, catalog, limiter, registry, clock

    def adapters(self, tenant: Tenant) -> dict[str, AdapterInfo]:
        """The adapters this tenant may use, by name: the config's first, in order (the ids of /lora-adapters)."""
        return self.registry.visible(tenant)

    def adapter_names(self, tenant: Tenant) -> list[str]:
        return list(self.adapters(tenant))

    def resolve_scales(self, tenant: Tenant, model: str | None, lora: list[LoraEntry] | None) -> dict[str, float]:
        visible = self.adapter_names(tenant)
        defaults = {n: s for n, s in tenant.default_scales.items() if n in visible}  # a removed adapter's default is gone with it
        scales: dict[str, float] = {} if lora is not None else defaults
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
        return self.enabled(tenant, scales)

    def enabled(self, tenant: Tenant, scales: dict[str, float]) -> dict[str, float]:
        """The non-zero scales; 400 when they turn on more than one aLoRA (SPEC §4)."""
        scales = {n: s for n, s in scales.items() if s != 0.0}
        infos = self.adapters(tenant)
        if len({infos[n].fingerprint for n in scales if infos[n].is_alora}) > 1:
            raise APIError(400, "Cannot run multiple aLoRAs in a single request", "multiple_aloras")
        return scales

    def default_max_tokens(self, num_prompt_tokens: int) -> int:
        """max_tokens for a request that gives none: the configured default, at most what fits."""
        return max(0, min(self.config.http.max_tokens_default, self.catalog.max_positions - num_prompt_tokens))

    def timeout_s(self, asked_s: float | None) -> float:
        """The request's deadline: the server's, or less when the client asks for less."""
        limit = self.config.http.request_timeout_s
        return limit if asked_s is None else min(asked_s, limit)

    async def prepare(self, tenant: Tenant, prompt_ids: list[int], params: SamplingParams, scales: dict[str, float],
                      request_salt: str | None = None, cache_prompt: bool = True, timeout_s: float | None = None) -> Prepared:
        vocab = self.catalog.hparams.vocab_size
        bad = [t for t in prompt_ids if not 0 <= t < vocab]
        if bad:
            raise APIError(400, f"prompt token id {bad[0]} is out of range (vocabulary size {vocab})", "invalid_prompt")
        if not prompt_ids:
            raise APIError(400, "the prompt is empty", "invalid_prompt")
        bad = [t for t, _ in params.logit_bias if t >= vocab]
        if bad:
            raise APIError(400, f"logit_bias token id {bad[0]} is out of range (vocabulary size {vocab})", "invalid_value")
        limit = self.catalog.max_positions
        wanted = params.max_tokens if params.max_tokens != -1 else 0
        if len(prompt_ids) + wanted > limit or len(prompt_ids) >= limit:
            raise APIError(400, f"This model's maximum context length is {limit} tokens. However, you requested "
                           f"{len(prompt_ids) + wanted} tokens ({len(prompt_ids)} in the prompt, {wanted} for the completion).",
                           "context_length_exceeded")
        budget = len(prompt_ids) + params.n * (params.max_tokens if params.max_tokens != -1 else limit - len(prompt_ids))  # every choice's
        await self.limiter.spend(tenant, budget)
        # the affinity key uses the KV-relevant set: an aLoRA shares the base's prefix (SPEC §4)
        infos = self.adapters(tenant)
        adapters: dict[str, float] = {}  # by content: two names of one adapter are one adapter
        for name, scale in scales.items():
            adapters[infos[name].fingerprint] = adapters.get(infos[name].fingerprint, 0.0) + scale
        adapters = {fp: s for fp, s in adapters.items() if s != 0.0}
        aloras = {infos[name].fingerprint for name in scales if infos[name].is_alora}
        kv_scales = {fp: s for fp, s in adapters.items() if fp not in aloras}
        key = affinity_key(self.catalog.adapter_set_fingerprint(kv_scales), prompt_ids, self.config.cache.chunk_tokens)
        call = WorkerCall(
            request_id=uuid.uuid4().hex, prompt_ids=tuple(prompt_ids), params=params, adapters=adapters,
            cache_salt=tenant.cache_salt(request_salt), cache_prompt=cache_prompt,
            tenant=tenant.id,  # the worker shares its compute fairly between tenants
            timeout_s=self.timeout_s(timeout_s),
        )
        labels = {infos[name].fingerprint: name for name in scales}
        return Prepared(call, tenant, scales, adapters, labels, key, len(prompt_ids), self.clock())
