"""One replica of a shard, the worker side of the wire contract: built from a `WorkerSpec`
(the base model with the shard's pinned adapters on one device, an engine on its own
thread, and the prefix cache), it takes `WorkerCall`s and streams `Delta`s back
(worker/contract/calls.py). A request the worker refuses gets one `Delta.refused`.

Two ways to get the deltas: `generate(call)`, one stream per request (in-process
callers), or a channel: the caller (a gateway process) opens one stream per replica
with `channel(id)`, starts requests on it with `start(id, call)`, and gets every
request's deltas of an engine step as one batch. Across processes each streamed item
costs about a millisecond of CPU at each end, whatever its size (Ray's streaming
generators), so one item per step instead of one per request per step is what lets
HTTP keep up with the engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
import weakref
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from typing import Any

from worker.contract.calls import Delta, Usage, WorkerCall
from worker.contract.spec import WorkerSpec
from worker.engine.engine import Engine, EngineRequest
from worker.engine.loop import EngineLoop, Overloaded
from worker.engine.outputs import RequestOutput
from worker.engine.pins import NotHeld, Pins
from worker.engine.prefix_kv import open_prefix_cache
from worker.engine.runner import ModelRunner
from worker.formats.tokenizer import GGUFTokenizer
from worker.model.device import DeviceConfig

log = logging.getLogger(__name__)


def delta_of(out: RequestOutput) -> Delta:
    """An engine output as the wire's Delta; the last one carries the request's summary."""
    logprobs = tuple(out.logprobs) if out.logprobs else None
    result = out.result
    if result is None:
        return Delta(tuple(out.token_ids), out.text, logprobs, out.finish_reason, out.error, index=out.index, others_running=out.others_running)
    return Delta(
        tuple(out.token_ids), out.text, logprobs, out.finish_reason, out.error, result.error_status,
        usage=Usage(len(result.prompt_ids), len(result.token_ids), result.cached_tokens),
        queue_time_s=result.queue_time_s, prompt_time_s=result.prompt_time_s, decode_time_s=result.decode_time_s,
        prompt_logprobs=tuple(result.prompt_logprobs) if result.prompt_logprobs is not None else None,
        alora_activation=result.alora_activation, stop_word=result.stop_word, stop_logprob=result.stop_logprob,
        index=out.index, others_running=out.others_running,
    )


def merged(first: RequestOutput, then: RequestOutput) -> RequestOutput:
    """Two consecutive outputs of one choice as one (`then`'s end, if it ends it)."""
    logprobs = (first.logprobs or []) + (then.logprobs or []) if first.logprobs or then.logprobs else None
    return replace(then, token_ids=first.token_ids + then.token_ids, text=first.text + then.text, logprobs=logprobs)


class Mailbox:
    """Outputs from the engine's thread to their receivers on one event loop, with one wakeup
    of that loop for everything posted before it runs (a step's outputs for every request),
    not one per output: under load the loop wakes once per engine step. With `step_lock` (the
    engine loop's `delivering`), a wakeup that comes while a step's outputs are being posted
    waits for the rest of them, so they reach the loop together."""

    def __init__(self, loop: asyncio.AbstractEventLoop, step_lock: threading.Lock | None = None) -> None:
        self.loop = loop
        self._step_lock = step_lock
        self._items: list[tuple[Callable[[RequestOutput], None], RequestOutput]] = []
        self._pending = False
        self._lock = threading.Lock()

    def post(self, receive: Callable[[RequestOutput], None], out: RequestOutput) -> None:
        """From any thread: `receive(out)` runs on the loop (with the rest posted meanwhile)."""
        with self._lock:
            self._items.append((receive, out))
            if self._pending:
                return
            self._pending = True
        try:
            self.loop.call_soon_threadsafe(self._flush)
        except RuntimeError:  # the loop is closed: the caller cancels its request
            with self._lock:
                self._pending = False
            raise

    def _flush(self) -> None:
        with self._step_lock or contextlib.nullcontext(), self._lock:
            items, self._items, self._pending = self._items, [], False
        for receive, out in items:
            receive(out)


def coalesced(items: list[tuple[str, RequestOutput]]) -> list[tuple[str, RequestOutput]]:
    """Each request's consecutive outputs of one choice as one (a caller behind by several
    steps gets them together); the order within each request is kept."""
    out: list[tuple[str, RequestOutput]] = []
    latest: dict[str, int] = {}
    for request_id, o in items:
        i = latest.get(request_id)
        if i is not None and out[i][1].index == o.index and out[i][1].finish_reason is None:
            out[i] = (request_id, merged(out[i][1], o))
        else:
            latest[request_id] = len(out)
            out.append((request_id, o))
    return out


class Channel:
    """The replica's end of a channel (one caller's, or one `generate` call's own): the outputs
    of the requests started on it, handed over as one batch per read (everything since the
    last one), on the event loop."""

    def __init__(self) -> None:
        self.streams: dict[str, Any] = {}  # request id -> its engine stream (None while it is being submitted)
        self.cancelled: set[str] = set()  # cancelled while being submitted
        self.closed = False
        self._items: list[tuple[str, RequestOutput]] = []
        self._ready = asyncio.Event()

    def add(self, request_id: str, out: RequestOutput) -> None:
        self._items.append((request_id, out))
        self._ready.set()
        if out.is_finished:
            self.streams.pop(request_id, None)

    async def batch(self) -> list[tuple[str, Delta]]:
        await self._ready.wait()
        self._ready.clear()
        items, self._items = self._items, []
        return [(request_id, delta_of(out)) for request_id, out in coalesced(items)]

    def close(self) -> None:
        """The caller is gone: its requests stop and free their KV slots."""
        self.closed = True
        streams, self.streams = self.streams, {}
        for stream in streams.values():
            if stream is not None:
                stream.cancel()


def memory_report(runner: ModelRunner, base_bytes: int) -> dict[str, int]:
    """Bytes this replica holds: the base weights, the adapters, and (on CUDA) all the device has allocated."""
    import torch

    report = {"base_bytes": base_bytes, "adapter_bytes": runner.lora.nbytes()}
    if runner.config.torch_device.type == "cuda":
        report["device_allocated_bytes"] = torch.cuda.memory_allocated(runner.config.torch_device)
    return report


def thread_metrics(engine: Engine) -> str:
    if engine.threads is None:  # not on a CPU
        return ""
    lines = ["# HELP loraplex_worker_decode_threads CPU threads a pass that only decodes runs on now (configured, or measured with engine.decode_threads auto)",
             "# TYPE loraplex_worker_decode_threads gauge",
             f"loraplex_worker_decode_threads {engine.threads.current}",
             "# HELP loraplex_worker_decode_thread_switches_total times the measured decode thread count changed (auto)",
             "# TYPE loraplex_worker_decode_thread_switches_total counter",
             f"loraplex_worker_decode_thread_switches_total {engine.threads.num_switches}"]
    return "\n".join(lines) + "\n"


def adapter_metrics(pins: Pins, runner: ModelRunner) -> str:
    lines = ["# HELP loraplex_worker_adapters adapters this replica holds (taking requests, or draining)",
             "# TYPE loraplex_worker_adapters gauge",
             f'loraplex_worker_adapters{{state="held"}} {len(pins.held)}',
             f'loraplex_worker_adapters{{state="draining"}} {len(pins.draining)}',
             "# HELP loraplex_worker_adapter_bytes device bytes of the adapters' weights this replica holds",
             "# TYPE loraplex_worker_adapter_bytes gauge",
             f"loraplex_worker_adapter_bytes {runner.lora.nbytes()}"]
    return "\n".join(lines) + "\n"


class ShardWorker:
    def __init__(self, spec: WorkerSpec) -> None:
        self.spec = spec
        names = {adapter.name: slot for slot, adapter in enumerate(spec.adapters)}

        def build() -> Engine:  # on the engine's thread, which then makes every torch call (worker/engine/loop.py)
            device = DeviceConfig.of(spec.device)
            device.apply_to_process()
            self.runner = ModelRunner.from_paths(spec.model_path, [adapter.path for adapter in spec.adapters], device)
            self.tokenizer = GGUFTokenizer(self.runner.base)
            self.prefix_cache = open_prefix_cache(self.runner, spec.cache, fingerprint_dir=spec.fingerprint_dir)
            self.base_bytes = sum(t.numel() * t.element_size() for t in self.runner.model.state_dict().values())  # adapters are not in it
            return Engine(self.runner, self.tokenizer, spec.engine, prefix_cache=self.prefix_cache)

        self.loop = EngineLoop(build, spec.engine.max_waiting)
        self.pins = Pins(self.loop, self.runner.base, names)
        self._mailboxes: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Mailbox] = weakref.WeakKeyDictionary()
        self._channels: dict[str, Channel] = {}

    def request(self, call: WorkerCall) -> EngineRequest:
        """The engine's request; NotHeld when it names an adapter (a fingerprint, or a deploy-time
        name) this replica does not hold."""
        slots: dict[int, float] = {}
        for adapter, scale in call.adapters.items():
            slot = self.pins.slot_of(adapter)
            slots[slot] = slots.get(slot, 0.0) + float(scale)
        return EngineRequest(
            call.request_id, list(call.prompt_ids), call.params, slots,
            cache_salt=call.cache_salt, cache_prompt=call.cache_prompt, tenant=call.tenant, timeout_s=call.timeout_s,
        )

    async def _submit(self, call: WorkerCall, receive: Callable[[RequestOutput], None]) -> tuple[Any, Delta | None]:
        """Start `call`, its outputs going to `receive` on this event loop: (its engine stream,
        None), or (None, the refusal) when the worker does not take it."""
        mailbox = self._mailbox()
        try:
            request = self.request(call)
        except NotHeld as e:  # routed here before a pin arrived or after it left: the gateway tries another replica
            return None, Delta.refused(str(e), status=503)
        try:  # the cache lookup runs off the event loop
            return await asyncio.to_thread(self.loop.submit, request, lambda out: mailbox.post(receive, out)), None
        except (ValueError, TypeError, ArithmeticError) as e:  # RequestError, MultipleALoRAError, bad numbers: the request's fault
            return None, Delta.refused(str(e))
        except Overloaded as e:
            return None, Delta.refused(str(e), status=503)
        except Exception:
            log.exception("request %s could not be submitted", call.request_id)
            return None, Delta.refused("internal error in the worker", status=500)

    async def generate(self, call: WorkerCall) -> AsyncIterator[Delta]:
        """The request's deltas. Never raises for one request's sake: a request the worker
        refuses or fails ends with an error Delta carrying its status, so the replica stays
        healthy in the gateway's eyes (only a dead replica fails as a transport error)."""
        channel = Channel()  # a channel of its own: fed from the engine thread, no executor thread per stream
        stream, refusal = await self._submit(call, lambda out: channel.add(call.request_id, out))
        if refusal is not None:
            yield refusal
            return
        finished = False
        try:
            while not finished:
                for _, delta in await channel.batch():  # the caller is behind: what has come goes as one item per choice
                    finished = delta.is_finished
                    yield delta
        finally:
            if not finished:  # the caller went away (client disconnect, gateway cancel): free the KV slot now
                stream.cancel()

    async def channel(self, channel_id: str) -> AsyncIterator[list[tuple[str, Delta]]]:
        """Open a channel: first an empty batch (requests may be started on it from then on),
        then one batch of (request id, delta) per read. When the caller stops reading (it went
        away), the requests started on it are cancelled."""
        channel = self._channels[channel_id] = Channel()
        try:
            yield []
            while True:
                yield await channel.batch()
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
        channel.streams[call.request_id] = None
        stream, refusal = await self._submit(call, lambda out: channel.add(call.request_id, out))
        if stream is None:
            channel.streams.pop(call.request_id, None)
        elif channel.closed or call.request_id in channel.cancelled:  # stopped while it was being submitted
            channel.cancelled.discard(call.request_id)
            channel.streams.pop(call.request_id, None)
            stream.cancel()
        elif call.request_id in channel.streams:  # not finished already
            channel.streams[call.request_id] = stream
        return refusal

    def cancel(self, channel_id: str, request_id: str) -> None:
        """Stop a request started on a channel (its caller went away); a finished one: nothing."""
        channel = self._channels.get(channel_id)
        if channel is None or request_id not in channel.streams:
            return
        if channel.streams[request_id] is None:  # still being submitted: `start` cancels it
            channel.cancelled.add(request_id)
        else:
            channel.streams.pop(request_id).cancel()

    def _mailbox(self) -> Mailbox:
        """The running event loop's mailbox (one per loop: a replica has one; tests run several)."""
        loop = asyncio.get_running_loop()
        mailbox = self._mailboxes.get(loop)
        if mailbox is None:
            mailbox = self._mailboxes[loop] = Mailbox(loop, self.loop.delivering)
        return mailbox

    async def sync(self, version: int, pins: dict[str, str]) -> dict[str, Any]:
        """Hold exactly `pins` (fingerprint -> adapter file) from now on (worker/engine/pins.py)."""
        return await self.pins.sync(version, pins)

    def health(self) -> dict[str, Any]:
        return {"shard": self.spec.shard, "adapters": self.pins.held, "pid": os.getpid(), "cache": self.prefix_cache.health(),
                "pins": self.pins.state(), "memory": memory_report(self.runner, self.base_bytes)}

    def metrics(self) -> str:
        return self.prefix_cache.prometheus() + self.loop.engine.counters.prometheus() + thread_metrics(self.loop.engine) + adapter_metrics(self.pins, self.runner)

    def close(self) -> None:
        self.loop.close()
        self.prefix_cache.close()
