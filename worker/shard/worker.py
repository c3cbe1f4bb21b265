"""One replica of a shard: built from a `WorkerSpec` (the base model with the shard's
deploy-time adapters on one device, an engine on its own thread, and the prefix cache), it
takes `WorkerCall`s and streams `Delta`s back (worker/contract/calls.py). A request the
worker refuses gets one `Delta.refused`.

A caller (a gateway process) opens one channel per replica with `channel(id)`, starts
requests on it with `start(id, call)`, and gets every request's deltas of an engine step as
one batch (worker/shard/channel.py). The worker knows adapters by fingerprint only: a call
names them so, and `Residency` brings each onto the device (worker/residency/) and
gives the adapter slot that holds it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
import weakref
from collections.abc import AsyncIterator, Callable, Iterable
from typing import Any

from opentelemetry import trace

from cache.blobs import open_blob_store
from worker.contract.calls import CHANNEL_HEARTBEAT_S, Delta, WorkerCall
from worker.contract.identity import AdapterSlot, Fingerprint
from worker.contract.spec import WorkerSpec
from worker.contract.tracing import context_of, open_tracing
from worker.engine.engine import Engine, EngineRequest
from worker.engine.loop import EngineLoop, Overloaded, Subscription
from worker.engine.prefix_kv import open_prefix_cache
from worker.engine.runner import ModelRunner
from worker.formats.tokenizer import GGUFTokenizer
from worker.model.device import DeviceConfig
from worker.residency.device import Lease
from worker.residency.residency import NotHeld, Residency
from worker.shard.channel import CallerChannel, Mailbox
from worker.shard.metrics import adapter_metrics, memory_report, thread_metrics

log = logging.getLogger(__name__)

TTFT_WINDOW_S = 30.0  # the times to first token `autoscaling_stats` reports: those of requests finished this recently


class ShardWorker:
    def __init__(self, spec: WorkerSpec) -> None:
        self.spec = spec

        def build() -> Engine:  # on the engine's thread, which then makes every torch call (worker/engine/loop.py)
            device = DeviceConfig.of(spec.device)
            device.apply_to_process()
            self.runner = ModelRunner.from_paths(spec.model_path, spec.adapter_paths, device)
            self.tokenizer = GGUFTokenizer(self.runner.base)
            self.prefix_cache = open_prefix_cache(self.runner, spec.cache, fingerprint_dir=spec.fingerprint_dir)
            self.base_bytes = sum(t.numel() * t.element_size() for t in self.runner.model.state_dict().values())  # adapters are not in it
            return Engine(self.runner, self.tokenizer, spec.engine, prefix_cache=self.prefix_cache)

        self.loop = EngineLoop(build, spec.engine.max_waiting)
        self.tracing = open_tracing(spec.tracing, "worker")  # its own exporter: a replica is a process of its own
        self.residency = Residency(self.loop, self.runner.base, None if spec.blob_store is None else open_blob_store(spec.blob_store),
                                   spec.residency)
        self._mailboxes: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Mailbox] = weakref.WeakKeyDictionary()
        self._channels: dict[str, CallerChannel] = {}

    def request(self, call: WorkerCall, lease: Lease) -> EngineRequest:
        """The engine's request, its adapters in the slots `lease` holds them in; what it waited for them
        to come up is taken from its deadline."""
        scales_by_slot: dict[AdapterSlot, float] = {}
        for fingerprint, scale in call.scales_by_fingerprint.items():
            slot = lease.slots[Fingerprint(fingerprint)]
            scales_by_slot[slot] = scales_by_slot.get(slot, 0.0) + float(scale)
        timeout_s = None if call.timeout_s is None else max(call.timeout_s - lease.waited_s, 1e-3)
        return EngineRequest(
            call.request_id, list(call.prompt_ids), call.params, scales_by_slot,
            cache_salt=call.cache_salt, cache_prompt=call.cache_prompt, tenant=call.tenant, timeout_s=timeout_s,
        )

    async def _submit(self, call: WorkerCall, receive: Callable[[Delta], None]) -> tuple[Subscription | None, Delta | None]:
        """Start `call`, its deltas going to `receive` on this event loop: (its subscription,
        None), or (None, the refusal) when the worker does not take it."""
        mailbox = self._mailbox()
        if call.traceparent is not None and self.tracing.is_enabled:
            receive = _traced(self.tracing.tracer, call, self.spec.shard, receive, time.time_ns())
        try:  # its adapters onto the device (those not there come up now, off the step loop)
            lease = await self.residency.acquire(map(Fingerprint, call.scales_by_fingerprint), call.timeout_s)
        except NotHeld as e:  # routed here before it was wanted here or after it left: the gateway tries another replica
            return None, Delta.refused(str(e), status=503, request_id=call.request_id)
        except Overloaded as e:  # no room on the device in time, or the store could not give it
            return None, Delta.refused(str(e), status=503, request_id=call.request_id)
        try:  # the cache lookup runs off the event loop
            request = self.request(call, lease)
            return await asyncio.to_thread(self.loop.submit, request, lambda delta: mailbox.post(receive, delta)), None
        except (ValueError, TypeError, ArithmeticError) as e:  # RequestError, MultipleALoRAError, bad numbers: the request's fault
            return None, Delta.refused(str(e), request_id=call.request_id)
        except Overloaded as e:
            return None, Delta.refused(str(e), status=503, request_id=call.request_id)
        except Exception:
            log.exception("request %s could not be submitted", call.request_id)
            return None, Delta.refused("internal error in the worker", status=500, request_id=call.request_id)
        finally:  # submitted: the engine keeps its slots from eviction now
            lease.release()

    async def channel(self, channel_id: str) -> AsyncIterator[list[Delta]]:
        """Open a channel: first an empty batch (requests may be started on it from then on),
        then one batch of deltas per read, or an empty one each CHANNEL_HEARTBEAT_S with none
        (the caller's sign the replica is there). When the caller stops reading (it went away),
        the requests started on it are cancelled."""
        channel = self._channels[channel_id] = CallerChannel()
        try:
            yield []
            while True:
                yield await channel.batch(CHANNEL_HEARTBEAT_S)
        finally:
            self._channels.pop(channel_id, None)
            channel.close()

    async def start(self, channel_id: str, call: WorkerCall) -> Delta | None:
        """Start `call` on an open channel: None, its deltas then come on the channel (the last
        one `is_finished`), or the refusal. LookupError when no such channel is open here (a
        restarted replica): the caller opens a new one."""
        channel = self._channels.get(channel_id)
        if channel is None:
            raise LookupError(f"no channel {channel_id!r} is open on this replica")
        channel.running[call.request_id] = None
        subscription, refusal = await self._submit(call, channel.add)
        if subscription is None:
            channel.running.pop(call.request_id, None)
        elif channel.closed or call.request_id in channel.cancelled:  # stopped while it was being submitted
            channel.cancelled.discard(call.request_id)
            channel.running.pop(call.request_id, None)
            subscription.cancel()
        elif call.request_id in channel.running:  # not finished already
            channel.running[call.request_id] = subscription
        return refusal

    def cancel(self, channel_id: str, request_id: str) -> None:
        """Stop a request started on a channel (its caller went away); a finished one: nothing."""
        channel = self._channels.get(channel_id)
        if channel is None or request_id not in channel.running:
            return
        if channel.running[request_id] is None:  # still being submitted: `start` cancels it
            channel.cancelled.add(request_id)
        else:
            channel.running.pop(request_id).cancel()

    def _mailbox(self) -> Mailbox:
        """The running event loop's mailbox (one per loop: a replica has one; tests run several)."""
        loop = asyncio.get_running_loop()
        mailbox = self._mailboxes.get(loop)
        if mailbox is None:
            mailbox = self._mailboxes[loop] = Mailbox(loop, self.loop.delivering)
        return mailbox

    async def sync(self, version: int, pins: Iterable[Fingerprint]) -> dict[str, Any]:
        """Serve exactly `pins` from now on, fetching new ones from the adapter store (worker/residency/residency.py)."""
        return await self.residency.sync(version, pins)

    def health(self) -> dict[str, Any]:
        return {"shard": self.spec.shard, "adapters": self.residency.held, "pid": os.getpid(), "cache": self.prefix_cache.health(),
                "pins": self.residency.state(), "memory": memory_report(self.runner, self.base_bytes), "requests": self._requests()}

    def _requests(self) -> dict[str, int]:
        """Sequences the engine runs and has waiting (read outside its thread, as the loop's
        `num_queued` is: an estimate)."""
        scheduler = self.loop.engine.scheduler
        return {"running": len(scheduler.running), "waiting": scheduler.num_waiting}

    def autoscaling_stats(self) -> dict[str, float]:
        """What the shard's autoscaling policy reads of this replica (gateway/cluster/autoscaling.py): its KV
        slots, requests running and waiting, the prefill time of the prompt tokens queued, and the 90th
        percentile of recent times to first token (-1: none lately). Read outside the engine's thread: an estimate."""
        engine = self.loop.engine
        scheduler = engine.scheduler
        queued_tokens = sum(seq.num_pending for seq in list(scheduler.running) + scheduler.waiting if seq.is_prefilling)
        now = engine.clock()
        recent = sorted(ttft for at, ttft in list(engine.counters.ttfts) if now - at <= TTFT_WINDOW_S)
        return {"slots": float(self.spec.engine.num_seq_slots), "running": float(len(scheduler.running)),
                "waiting": float(scheduler.num_waiting + self.loop.num_queued_adds()),
                "backlog_s": queued_tokens * (engine.costs.prompt_token_s or 0.0),
                "ttft_p90_s": recent[min(len(recent) - 1, int(0.9 * len(recent)))] if recent else -1.0}

    def metrics(self) -> str:
        engine = self.loop.engine
        return (self.prefix_cache.prometheus() + engine.counters.prometheus() + thread_metrics(engine)
                + adapter_metrics(self.residency))

    def close(self) -> None:
        self.loop.close()
        self.residency.memory.close()
        self.prefix_cache.close()
        self.tracing.close()


def _traced(tracer: trace.Tracer, call: WorkerCall, shard: str, receive: Callable[[Delta], None],
            started_ns: int) -> Callable[[Delta], None]:
    """`receive`, and once the request is over, its spans under the gateway's (the call's traceparent),
    placed from the engine's own timings of it (no clock read in its step loop): worker.request, from
    `started_ns` (submitted) to now, with its queue wait, prefill and decode."""

    def traced(delta: Delta) -> None:
        receive(delta)
        if not delta.is_finished:
            return
        attributes = {"loraplex.tenant": call.tenant, "loraplex.shard": shard, "loraplex.finish_reason": delta.finish_reason or ""}
        if delta.usage is not None:
            attributes |= {"loraplex.prompt_tokens": delta.usage.prompt_tokens, "loraplex.cached_tokens": delta.usage.cached_tokens,
                           "loraplex.completion_tokens": delta.usage.completion_tokens}
        request = tracer.start_span("worker.request", context_of(call.traceparent), trace.SpanKind.SERVER, attributes,
                                    start_time=started_ns)
        context = trace.set_span_in_context(request)
        prefilled_s = delta.prompt_time_s  # arrival to first token
        for name, start_s, end_s in (("worker.queue", 0.0, delta.queue_time_s), ("worker.prefill", delta.queue_time_s, prefilled_s),
                                     ("worker.decode", prefilled_s, prefilled_s + delta.decode_time_s)):
            tracer.start_span(name, context, start_time=started_ns + int(start_s * 1e9)).end(started_ns + int(end_s * 1e9))
        if delta.finish_reason == "error":
            request.set_status(trace.Status(trace.StatusCode.ERROR, delta.error))
        request.end()

    return traced
