"""A prepared request's answer (torch-free): one JSON body once the worker is done, or server-sent
events as its deltas come. Either way the tenant's in-flight gauge and the latency metrics are
kept, the headers name the shard and replica that ran it, and every way it ends settles what it
held of the tenant's limits (gateway/requests/admission.py): finished, failed, cancelled, or refused."""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import Gauge

from gateway.errors import GatewayError
from gateway.http.errors import openai_error
from gateway.http.formatting import named_sse, sse, summary
from gateway.metrics import GatewayMetrics, adapter_label
from gateway.requests.admission import Admission, Prepared
from gateway.requests.dispatch import Dispatcher
from gateway.tenancy.usage_event import UsageEvent
from worker.contract.calls import Delta

JSONObject = dict[str, Any]
UsageChunk = Callable[[Sequence[Delta]], JSONObject]


class Formatter(Protocol):
    """An API's answer shape (gateway/api/openai/formats.py, llama_formats.py, anthropic_formats.py,
    responses_formats.py): the whole answer, or the event data of one delta (`first`: the first of
    its choice). A formatter may also say how its stream frames events (`named_events`: each event
    is sent as `event: <its "type">`, as the Anthropic and Responses APIs do) and what its error
    event holds (`error_event`; default: the error's body)."""

    def whole(self, deltas: list[Delta]) -> JSONObject: ...

    def chunk(self, delta: Delta, first: bool) -> JSONObject | list[JSONObject]: ...  # several: tool calls


def _framing(formatter: Formatter) -> tuple[Callable[[JSONObject | str], bytes], Callable[[GatewayError], JSONObject]]:
    """How `formatter`'s stream frames an event, and its error event."""
    frame = named_sse if getattr(formatter, "named_events", False) else sse
    return frame, getattr(formatter, "error_event", openai_error)


def route_headers(prepared: Prepared) -> dict[str, str]:
    headers = {"x-loraplex-shard": prepared.route.get("shard", ""), "x-loraplex-replica": prepared.route.get("replica", "")}
    if prepared.cold_start_s:  # it waited for a replica of a shard asleep to start (its timings count the wait too)
        headers["x-loraplex-cold-start-ms"] = str(round(prepared.cold_start_s * 1e3))
    return headers


@dataclass(frozen=True)
class Responder:
    """What answering a prepared request takes: the dispatcher runs it, admission settles what it
    held, the metrics count it, and usage names the model it ran on."""

    dispatcher: Dispatcher
    admission: Admission
    metrics: GatewayMetrics
    model_name: str


class Timing:
    """A request's latency and time to first token, recorded once it is done, and its end settled
    once (gateway/requests/admission.py `settle`): what it used counted when it finished, or what was sent
    of it when its stream ended early, or nothing when it never ran."""

    def __init__(self, responder: Responder, prepared: Prepared, endpoint: str) -> None:
        self.responder, self.tenant, self.endpoint = responder, prepared.tenant, endpoint
        self.prepared = prepared
        self.adapter = adapter_label(prepared.names_by_fingerprint.values())
        self.started_s, self.first_token_s = time.perf_counter(), None
        self.num_sent_tokens = 0  # generated tokens streamed so far
        self.is_counted = False

    def _event(self, final: Delta | None, finish_reason: str) -> UsageEvent:
        usage = final.usage if final is not None and final.usage is not None else None
        prompt = usage.prompt_tokens if usage else self.prepared.num_prompt_tokens
        reservation = self.prepared.hold.reservation
        return UsageEvent(self.prepared.call.request_id, self.tenant.id, self.tenant.key_id, self.adapter,
                          self.responder.model_name, prompt, usage.cached_tokens if usage else 0,
                          usage.completion_tokens if usage else self.num_sent_tokens, finish_reason, time.time(),
                          None if reservation is None else reservation.at_s)

    async def count(self, final: Delta) -> None:
        """A finished request's usage, written before its answer ends."""
        self.is_counted = True
        await self.responder.admission.settle(self.prepared.hold, self._event(final, final.finish_reason or "stop"))

    def failed(self, error: GatewayError) -> None:
        """The request's answer is `error`; when it ran before it failed (its deadline), what it used
        counts, else it never ran."""
        if error.num_generated_tokens is not None:
            self.num_sent_tokens = error.num_generated_tokens
            self.count_partial("error")
        else:
            self.never_ran()
        self.done(error.status, None)

    def count_partial(self, finish_reason: str) -> None:
        """A stream that ended early (`cancelled`, `error`): its prompt and the tokens sent, written soon."""
        if not self.is_counted:
            self.is_counted = True
            self.responder.admission.settle_soon(self.prepared.hold, self._event(None, finish_reason))

    def never_ran(self) -> None:
        """It ended before any of it ran (refused, or cancelled waiting): nothing counted, everything given back."""
        if not self.is_counted:
            self.is_counted = True
            self.responder.admission.settle_soon(self.prepared.hold, None)

    def cancelled(self) -> None:
        """Cancelled or failed outside the API's errors: once a worker took it (routed), its prompt and what
        it generated count, as a stream the client left; before that, nothing ran."""
        if not self.prepared.route:
            self.never_ran()
            return
        self.num_sent_tokens = max(self.num_sent_tokens, self.prepared.num_generated_tokens)
        self.count_partial("cancelled")

    def token(self) -> None:
        if self.first_token_s is None:
            self.first_token_s = time.perf_counter()

    def done(self, status: int, final: Delta | None) -> None:
        to_first_token_s = None if self.first_token_s is None else self.first_token_s - self.started_s
        self.responder.metrics.finished(self.tenant.id, self.adapter, self.endpoint, status,
                                      time.perf_counter() - self.started_s, to_first_token_s, final)


async def respond(responder: Responder, prepared: Prepared, endpoint: str, formatter: Formatter, is_streamed: bool,
                  usage_chunk: UsageChunk | None = None, done_marker: bool = True) -> Response:
    """The answer: `formatter.whole` of every delta, or an event per `formatter.chunk`, then
    `usage_chunk` of each choice's last delta (when given) and `[DONE]` (with `done_marker`)."""
    timing = Timing(responder, prepared, endpoint)
    in_flight = responder.metrics.in_flight.labels(prepared.tenant.id)
    in_flight.inc()
    if not is_streamed:
        try:
            deltas = await responder.dispatcher.collect(prepared, on_first=timing.token)
        except GatewayError as e:
            timing.failed(e)
            raise
        except BaseException:
            timing.cancelled()  # cancelled (the client left, a batch's other request failed) or failed
            raise
        finally:
            in_flight.dec()
        final = summary([d for d in deltas if d.finish_reason is not None])
        await timing.count(final)
        timing.done(200, final)
        return JSONResponse(formatter.whole(deltas), headers=route_headers(prepared))
    deltas = responder.dispatcher.stream(prepared)
    try:
        first = await anext(deltas)  # errors before the first token are still HTTP errors
    except BaseException as e:
        in_flight.dec()
        if isinstance(e, GatewayError):
            timing.failed(e)
        else:
            timing.cancelled()
            timing.done(500, None)
        raise
    events = _events(responder.dispatcher, prepared, first, deltas, formatter, usage_chunk, done_marker, timing, in_flight)
    return StreamingResponse(events, media_type="text/event-stream", headers=route_headers(prepared))


async def _events(dispatcher: Dispatcher, prepared: Prepared, first: Delta, deltas: AsyncGenerator[Delta, None],
                  formatter: Formatter, usage_chunk: UsageChunk | None, done_marker: bool, timing: Timing,
                  in_flight: Gauge) -> AsyncIterator[bytes]:
    """The events of a streamed answer, from its `first` delta on. A worker's error delta ends it
    with an error event (its status goes to the metrics: the HTTP status was sent with the first)."""
    finals: list[Delta] = []  # each choice's last delta
    status, started_choices = 200, set()
    frame, error_event = _framing(formatter)
    try:
        delta = first
        while True:
            timing.token()
            if delta.finish_reason == "error":
                error = dispatcher.error_of(delta, prepared)
                status = error.status
                yield frame(error_event(error))
                break
            if delta.finish_reason is not None:
                finals.append(delta)
            if delta.is_finished:
                await timing.count(summary(finals))  # before the answer's last events
            out = formatter.chunk(delta, delta.index not in started_choices)
            for event in out if isinstance(out, list) else [out]:
                yield frame(event)
            timing.num_sent_tokens += len(delta.token_ids)
            started_choices.add(delta.index)
            if delta.is_finished:
                if usage_chunk is not None:
                    yield frame(usage_chunk(finals))
                break
            delta = await anext(deltas)
        if done_marker:
            yield frame("[DONE]")
    finally:
        timing.count_partial("error" if status != 200 else "cancelled")
        await deltas.aclose()  # a client that went away cancels the worker's request
        in_flight.dec()
        timing.done(status, summary(finals) if finals and status == 200 else None)
