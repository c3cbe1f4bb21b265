"""A request's spans in the gateway (OpenTelemetry): the deployment's `tracing` settings
(TracingSettings, shared with the workers: worker/contract/tracing.py), the time its HTTP request
arrived, and what the request path records under the HTTP request's span (gateway/http/observed.py):

    admission   arrival to admitted: authenticated, parsed, tokenized, checked, counted against its limits
    route       one per attempt: the replica chosen (failover: the next attempt's), until that replica is done
      queue     the call sent until the replica's first delta: waiting for the worker
      (worker)  the worker's spans of the call, in its own process: worker.request, .queue, .prefill, .decode

Which requests are traced is the gateway's `sample_ratio` alone: a caller's traceparent names the
trace they join, but its sampled flag neither forces nor stops a trace (worker/contract/tracing.py).
Spans are started and ended explicitly, never made current: the request path runs in async
generators, whose steps may run in other tasks' contexts.
"""

from __future__ import annotations

import time
from contextvars import ContextVar, Token
from dataclasses import replace

from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from gateway.metrics import adapter_label
from gateway.policy.routing import ReplicaView
from gateway.requests.admission import Prepared
from worker.contract.calls import Delta, WorkerCall
from worker.contract.tracing import Tracing, TracingSettings, context_of, open_tracing, traceparent_of

__all__ = ["Attempt", "RequestSpans", "Tracing", "TracingSettings", "arrived", "context_of", "open_tracing", "reset_arrived"]

_ARRIVED_NS: ContextVar[int | None] = ContextVar("loraplex_arrived_ns", default=None)  # of the HTTP request being served


def arrived(at_ns: int) -> Token:
    """The HTTP request being served arrived at `at_ns` (wall clock): its admission span's start."""
    return _ARRIVED_NS.set(at_ns)


def reset_arrived(token: Token) -> None:
    _ARRIVED_NS.reset(token)


class RequestSpans:
    """An admitted request's spans, children of the span current where it is made (its HTTP
    request's): its admission, recorded now, then its attempts."""

    def __init__(self, tracer: trace.Tracer, prepared: Prepared, policy: str) -> None:
        self.tracer, self.policy = tracer, policy
        self.request = trace.get_current_span()
        self.context = trace.set_span_in_context(self.request)
        self.num_attempts = 0
        if not self.request.is_recording():
            return
        attributes = {"loraplex.tenant": prepared.tenant.id, "loraplex.adapter": adapter_label(prepared.names_by_fingerprint.values())}
        self.request.set_attributes(attributes)
        now_ns = time.time_ns()
        admission = tracer.start_span("admission", self.context, start_time=_ARRIVED_NS.get() or now_ns,
                                      attributes={**attributes, "loraplex.prompt_tokens": prepared.num_prompt_tokens})
        admission.end(now_ns)
        self._since_ns = now_ns  # the next attempt's route span starts here (its choice, and any wait for a replica)

    def attempt(self, replica: ReplicaView, call: WorkerCall) -> Attempt:
        self.num_attempts += 1
        if not self.request.is_recording():
            return Attempt(trace.INVALID_SPAN, call, self.tracer)
        attributes = {"loraplex.replica": replica.replica_id, "loraplex.shard": replica.shard,
                      "loraplex.routing.policy": self.policy, "loraplex.attempt": self.num_attempts}
        span = self.tracer.start_span("route", self.context, SpanKind.CLIENT, attributes, start_time=self._since_ns)
        return Attempt(span, replace(call, traceparent=traceparent_of(span)), self.tracer, self)


class Attempt:
    """One replica's run of a request: its `route` span and, until the first delta, its `queue` span."""

    def __init__(self, span: trace.Span, call: WorkerCall, tracer: trace.Tracer, spans: RequestSpans | None = None) -> None:
        self.span, self.call, self._spans = span, call, spans  # call: with the route span's traceparent
        self._queue = tracer.start_span("queue", trace.set_span_in_context(span)) if span.is_recording() else None

    def answered(self, first: Delta) -> None:
        """The replica's first delta (a refusal, when it has a status)."""
        if self._queue is not None:
            if first.status is not None:
                self._queue.set_attribute("loraplex.refused_status", first.status)
            self._queue.end()
            self._queue = None

    def failed(self, error: BaseException) -> None:
        """The replica failed the request (it goes to another, if any is left)."""
        if self.span.is_recording():
            self.span.record_exception(error)
            self.span.set_status(Status(StatusCode.ERROR, type(error).__name__))

    def end(self) -> None:
        if self._queue is not None:
            self._queue.end()
        if self.span.is_recording():
            self.span.end()
            self._spans._since_ns = time.time_ns()
