"""What a tenant's request becomes before it is routed (torch-free): the adapters it names
resolved through the tenant's ACL, its numbers checked against the model, its cost
counted against the tenant's limits, and the `WorkerCall` a worker will run.

Its cost is the most it may use (prompt + n x its max_tokens bound), held from admission
until it ends: reserved of the tenant's token quotas (gateway/tenancy/quota.py) and taken of its
per-minute token limit (gateway/tenancy/ratelimit.py). `settle` ends the hold with what it used: the
usage counted (which settles the reservation) and the unused tokens given back to the limit;
a request that never ran gives everything back. A `Prepared` collected before it was settled
(a route refused it after admission, or its stream never started) is settled as never run
DROPPED_AFTER_S later, unless its end settled it meanwhile (a stream its client left is
collected before its generator's cleanup counts it); a reservation left by a gateway that
died expires.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from gateway.catalog import AdapterInfo, Catalog
from gateway.config import ServeConfig
from gateway.errors import GatewayError
from gateway.policy.routing import affinity_key
from gateway.registry.registry import AdapterRegistry
from gateway.tenancy.quota import RESERVATION_MARGIN_S, QuotaExceeded, QuotaUnavailable, Reservation
from gateway.tenancy.ratelimit import RateLimiter, TokenSpend
from gateway.tenancy.tenants import Tenant
from gateway.tenancy.usage import UsageLedger
from gateway.tenancy.usage_event import UsageEvent
from worker.contract.calls import WorkerCall
from worker.contract.identity import AdapterName, Fingerprint, ScalesByFingerprint, ScalesByName
from worker.contract.params import SamplingParams
from worker.formats.tokenizer import TokenizerError, check_ids

EXCEEDS_CONTEXT = "exceed_context_size_error"  # llama-server's error type, with n_prompt_tokens and n_ctx
DROPPED_AFTER_S = 5.0
log = logging.getLogger(__name__)


@dataclass
class Hold:
    """What a request holds of its tenant's limits from admission until `Admission.settle`."""

    num_tokens: int  # the most it may use: prompt + n x its max_tokens bound
    reservation: Reservation | None = None  # of its quotas (None: the tenant has none)
    spend: TokenSpend | None = None  # of its per-minute token limit (None: it has none)
    is_settled: bool = False
    keeper: asyncio.Task | None = None  # renews the reservation while the request runs past its lifetime


@dataclass
class Prepared:
    """A checked request, ready to route: its call (which carries its adapters by fingerprint)
    and what only the gateway knows of it."""

    call: WorkerCall
    tenant: Tenant
    names_by_fingerprint: dict[Fingerprint, AdapterName]  # the tenant's names for the call's adapters (errors, metric labels)
    affinity: bytes
    num_prompt_tokens: int
    admitted_s: float  # when it was admitted, on the gateway's clock (its deadline counts from here)
    hold: Hold  # what it holds of the tenant's limits until it ends
    route: dict[str, str] = field(default_factory=dict)  # filled once routed: replica, shard
    cold_start_s: float = 0.0  # how long it waited for a replica of an autoscaled shard to start (one asleep)
    num_generated_tokens: int = 0  # what its workers generated so far (what a request cancelled after it ran used)

    @property
    def scales_by_fingerprint(self) -> ScalesByFingerprint:
        """What the worker runs and routing matches."""
        return self.call.scales_by_fingerprint



class AdapterRef(Protocol):
    """One adapter a request names, by `name` or by `id` (its index in the tenant's adapter list)."""

    @property
    def id(self) -> int | None: ...
    @property
    def name(self) -> str | None: ...
    @property
    def scale(self) -> float: ...

class Admission:
    def __init__(self, config: ServeConfig, catalog: Catalog, limiter: RateLimiter, registry: AdapterRegistry,
                 clock: Callable[[], float] = time.monotonic, usage: UsageLedger | None = None) -> None:
        self.config, self.catalog, self.limiter, self.registry, self.clock = config, catalog, limiter, registry, clock
        self.usage = usage
        self._tasks: set[asyncio.Task] = set()

    def adapters(self, tenant: Tenant) -> dict[str, AdapterInfo]:
        """The adapters this tenant may use, by name: the config's first, in order (the ids of /lora-adapters)."""
        return self.registry.visible(tenant)

    def adapter_names(self, tenant: Tenant) -> list[str]:
        return list(self.adapters(tenant))

    def resolve_scales(self, tenant: Tenant, model: str | None, lora: Sequence[AdapterRef] | None) -> dict[AdapterName, float]:
        """The adapters a request enables, by the tenant's names: `model` (an adapter's name) and
        `lora` (names or ids of /lora-adapters), or the tenant's defaults when it gives no `lora`."""
        visible = self.adapter_names(tenant)
        defaults = {n: s for n, s in tenant.default_scales.items() if n in visible}  # a removed adapter's default is gone with it
        scales: dict[AdapterName, float] = {} if lora is not None else defaults
        if model is not None and model != self.catalog.model_name:
            if model in visible:
                scales[model] = 1.0
            elif self.config.http.unknown_model == "error":
                raise GatewayError(404, f"model {model!r} not found", "model_not_found")
            # else (unknown_model: base) the base, as for its own name; any name this key cannot use, another
            # tenant's adapter too, takes this one path, so the answer tells nothing of other tenants' names
        for entry in lora or []:
            if entry.name is not None:
                if entry.name not in visible:
                    raise GatewayError(404, f"adapter {entry.name!r} not found", "adapter_not_found")
                name = entry.name
            else:
                if entry.id >= len(visible):
                    raise GatewayError(404, f"adapter id {entry.id} not found (this key has {len(visible)} adapters)", "adapter_not_found")
                name = visible[entry.id]
            scales[name] = scales.get(name, 0.0) + entry.scale
        return self.enabled(tenant, scales)

    def enabled(self, tenant: Tenant, scales: dict[AdapterName, float]) -> dict[AdapterName, float]:
        """The non-zero scales; 400 when they turn on more than one aLoRA (llama.cpp's rule)."""
        scales = {n: s for n, s in scales.items() if s != 0.0}
        infos = self.adapters(tenant)
        if len({infos[n].fingerprint for n in scales if infos[n].is_alora}) > 1:
            raise GatewayError(400, "Cannot run multiple aLoRAs in a single request", "multiple_aloras")
        if len({infos[n].fingerprint for n in scales}) > 1 and any(infos[n].is_dora for n in scales):
            raise GatewayError(400, "Cannot run a DoRA adapter together with other adapters in a single request", "dora_stacked")
        return scales

    def default_max_tokens(self, num_prompt_tokens: int) -> int:
        """max_tokens for a request that gives none: the configured default, at most what fits."""
        return max(0, min(self.config.http.max_tokens_default, self.catalog.max_positions - num_prompt_tokens))

    def timeout_s(self, asked_s: float | None) -> float:
        """The request's deadline: the server's, or less when the client asks for less."""
        limit = self.config.http.request_timeout_s
        return limit if asked_s is None else min(asked_s, limit)

    async def prepare(self, tenant: Tenant, prompt_ids: list[int], params: SamplingParams, scales_by_name: ScalesByName,
                      request_salt: str | None = None, cache_prompt: bool = True, timeout_s: float | None = None) -> Prepared:
        """Check the request against the model (the one place: the worker trusts it), count it
        against the tenant's limits, and turn its adapters' names into fingerprints."""
        vocab = self.catalog.hparams.vocab_size
        if not prompt_ids:
            raise GatewayError(400, "the prompt is empty", "invalid_prompt")
        try:
            check_ids(prompt_ids, vocab, "prompt token id")
        except TokenizerError as e:
            raise GatewayError(400, str(e), "invalid_prompt") from e
        try:
            check_ids((t for t, _ in params.logit_bias), vocab, "logit_bias token id")
        except TokenizerError as e:
            raise GatewayError(400, str(e), "invalid_value") from e
        limit = self.catalog.max_positions
        wanted = params.max_tokens if params.max_tokens != -1 else 0
        if len(prompt_ids) + wanted > limit or len(prompt_ids) >= limit:
            raise GatewayError(400, f"This model's maximum context length is {limit} tokens. However, you requested "
                           f"{len(prompt_ids) + wanted} tokens ({len(prompt_ids)} in the prompt, {wanted} for the completion).",
                           "context_length_exceeded", kind=EXCEEDS_CONTEXT, n_prompt_tokens=len(prompt_ids), n_ctx=limit)
        generated = params.max_tokens if params.max_tokens != -1 else limit - len(prompt_ids)
        request_id = uuid.uuid4().hex
        call_timeout_s = self.timeout_s(timeout_s)
        hold = Hold(len(prompt_ids) + params.n * generated)  # every choice's
        hold.reservation = await self._reserve(tenant, request_id, hold.num_tokens, call_timeout_s)
        try:
            hold.spend = await self.limiter.spend(tenant, hold.num_tokens)
            infos = self.adapters(tenant)  # read again: an adapter may have gone (or been hidden) meanwhile
            gone = [name for name in scales_by_name if name not in infos]
            if gone:
                raise GatewayError(404, f"adapter {gone[0]!r} not found", "adapter_not_found")
            scales_by_fingerprint: dict[Fingerprint, float] = {}  # by content: two names of one adapter are one adapter
            for name, scale in scales_by_name.items():
                fingerprint = Fingerprint(infos[name].fingerprint)
                scales_by_fingerprint[fingerprint] = scales_by_fingerprint.get(fingerprint, 0.0) + scale
            scales_by_fingerprint = {fp: s for fp, s in scales_by_fingerprint.items() if s != 0.0}
            # the affinity key uses the KV-relevant set: an aLoRA shares the base's prefix (worker/formats/alora.py)
            aloras = {infos[name].fingerprint for name in scales_by_name if infos[name].is_alora}
            kv_scales = {fp: s for fp, s in scales_by_fingerprint.items() if fp not in aloras}
            key = affinity_key(self.catalog.adapter_set_fingerprint(kv_scales), prompt_ids, self.config.cache.chunk_tokens)
            call = WorkerCall(
                request_id=request_id, prompt_ids=tuple(prompt_ids), params=params,
                scales_by_fingerprint=scales_by_fingerprint, cache_salt=tenant.cache_salt(request_salt),
                cache_prompt=cache_prompt, tenant=tenant.id,  # the worker shares its compute fairly between tenants
                timeout_s=call_timeout_s,
            )
            names_by_fingerprint = {Fingerprint(infos[name].fingerprint): name for name in scales_by_name}
        except BaseException:
            self.settle_soon(hold, None)  # refused after its reservation: nothing ran
            raise
        prepared = Prepared(call, tenant, names_by_fingerprint, key, len(prompt_ids), self.clock(), hold)
        if hold.reservation is not None and self.usage is not None:
            lifetime_s = hold.reservation.expires_s - hold.reservation.at_s
            hold.keeper = asyncio.get_running_loop().create_task(self._keep(hold, lifetime_s))
        if hold.reservation is not None or hold.spend is not None:
            finalizer = weakref.finalize(prepared, self._dropped, hold, asyncio.get_running_loop())
            finalizer.atexit = False
        return prepared

    async def _reserve(self, tenant: Tenant, request_id: str, num_tokens: int, timeout_s: float) -> Reservation | None:
        """`num_tokens` reserved of the tenant's quotas until the request ends (at the latest its deadline
        and the worker's grace, plus a margin); None when it has none. 429 when they do not fit, 503
        when they cannot be checked."""
        if self.usage is None or not (tenant.tokens_per_day or tenant.tokens_per_month):
            return None
        lifetime_s = timeout_s + self.config.routing.worker_grace_s + RESERVATION_MARGIN_S
        try:
            return await self.usage.reserve(tenant.id, request_id, num_tokens,
                                            {"day": tenant.tokens_per_day, "month": tenant.tokens_per_month}, lifetime_s)
        except QuotaExceeded as e:
            raise GatewayError(429, str(e), "quota_exceeded", {"Retry-After": str(e.retry_after_s)},
                           tokens_left=e.num_left) from e
        except QuotaUnavailable as e:
            log.warning("tenant %s refused: %s", tenant.id, e)
            raise GatewayError(503, f"{e}; retry later", "quota_unavailable", {"Retry-After": str(e.retry_after_s)}) from e

    # the end of a request

    async def settle(self, hold: Hold, event: UsageEvent | None) -> None:
        """The request ended: `event`, what it used, counted (which settles its reservation), or
        (None: it never ran) its reservation released; the tokens it did not use given back to the
        per-minute limit. Once per request; it completes even when the caller is cancelled."""
        if not hold.is_settled:
            await asyncio.shield(self._settle_task(hold, event))

    def settle_soon(self, hold: Hold, event: UsageEvent | None) -> None:
        """`settle`, without waiting for it."""
        if not hold.is_settled:
            self._settle_task(hold, event)

    async def _keep(self, hold: Hold, lifetime_s: float) -> None:
        """While the request runs, renew its reservation before it expires (half a margin before), by its
        lifetime each time: a request still running (its client reads slowly) keeps what it may use held."""
        assert hold.reservation is not None and self.usage is not None
        expires_s = hold.reservation.expires_s
        while not hold.is_settled:
            await asyncio.sleep(max(0.0, expires_s - RESERVATION_MARGIN_S / 2 - self.usage.clock()))
            if hold.is_settled:
                return
            expires_s = self.usage.clock() + lifetime_s
            if not await self.usage.renew(hold.reservation, expires_s):
                return

    def _settle_task(self, hold: Hold, event: UsageEvent | None) -> asyncio.Task:
        hold.is_settled = True
        if hold.keeper is not None:
            hold.keeper.cancel()
        self._tasks.add(task := asyncio.get_running_loop().create_task(self._settle(hold, event)))
        task.add_done_callback(self._tasks.discard)
        return task

    async def _settle(self, hold: Hold, event: UsageEvent | None) -> None:
        work = [self.limiter.refund(hold.spend, 0 if event is None else event.tokens)]
        if self.usage is not None and event is not None:
            work.append(self.usage.record(event))
        elif self.usage is not None and hold.reservation is not None:
            self.usage.release(hold.reservation)
        await asyncio.gather(*work)

    def _dropped(self, hold: Hold, loop: asyncio.AbstractEventLoop) -> None:
        """A Prepared collected (from any thread) before it was settled: settled as never run
        DROPPED_AFTER_S later, unless its end (a generator's cleanup, which runs after the
        collection) settles it first."""
        if not hold.is_settled:
            try:
                loop.call_soon_threadsafe(loop.call_later, DROPPED_AFTER_S, self.settle_soon, hold, None)
            except RuntimeError:  # its loop is closed: the reservation expires
                log.info("a request dropped after its event loop closed: its reservation expires")
