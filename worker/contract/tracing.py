"""Traces across the gateway and its workers (OpenTelemetry; torch-free): the deployment's
`tracing` settings, the tracer each process opens from them, and the W3C trace context a
`WorkerCall` carries from the gateway's span to the worker's.

Here, below both, because a worker runs in a process of its own (a Ray actor) and exports its
spans itself: it gets these settings in its `WorkerSpec`. Off (no `otlp_endpoint`), a process's
tracer is OpenTelemetry's no-op one and the SDK is not even imported.

Sampling is the gateway's alone. It is the edge: a caller's `traceparent` is untrusted input, so
the gateway continues the caller's trace id but decides by its own `sample_ratio`, drawn at random
(not from the trace id, which the caller chooses), whatever the header's sampled flag says. A
worker follows the gateway's decision: its parent is the gateway's span, in the call it was sent.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

_PROPAGATOR = TraceContextTextMapPropagator()


@dataclass(frozen=True)
class TracingSettings:
    """The deployment config's `tracing` (off unless `otlp_endpoint` is set)."""

    otlp_endpoint: str | None = None  # an OTLP/HTTP collector, e.g. http://otel-collector:4318 (spans go to <it>/v1/traces)
    service_name: str = "loraplex"  # the gateway's; workers report as <service_name>-worker
    sample_ratio: float = 1.0  # of the requests the gateway serves, whatever a caller's traceparent says

    def __post_init__(self) -> None:
        if self.otlp_endpoint is not None and not self.otlp_endpoint.startswith(("http://", "https://")):
            raise ValueError(f"otlp_endpoint must be an http:// or https:// URL, got {self.otlp_endpoint!r}")
        if not 0.0 <= self.sample_ratio <= 1.0:
            raise ValueError(f"sample_ratio must be between 0 and 1, got {self.sample_ratio}")
        if not self.service_name:
            raise ValueError("service_name must not be empty")

    @property
    def is_enabled(self) -> bool:
        return self.otlp_endpoint is not None


class Tracing:
    """One process's tracer (of one component: gateway or worker) and the exporter behind it."""

    def __init__(self, tracer: trace.Tracer, provider: Any = None) -> None:
        self.tracer, self._provider = tracer, provider  # provider: the SDK's TracerProvider, None when off

    @property
    def is_enabled(self) -> bool:
        return self._provider is not None

    def flush(self, timeout_ms: int = 5000) -> bool:
        """Export what is buffered now (tests; a stopping process)."""
        return self._provider is None or self._provider.force_flush(timeout_ms)

    def close(self) -> None:
        if self._provider is not None:
            self._provider.shutdown()


def open_tracing(settings: TracingSettings, component: str, rng: random.Random | None = None) -> Tracing:
    """A tracer that exports over OTLP/HTTP in batches, off the caller's thread; a no-op one when off.
    The gateway's samples by `rng` (a fresh one when None); a worker's follows its parent."""
    if not settings.is_enabled:
        return Tracing(trace.NoOpTracer())
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor
    from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

    if component == "gateway":
        sampler = _edge_sampler(settings.sample_ratio, rng or random.Random())
        name = settings.service_name
    else:
        sampler, name = ParentBased(TraceIdRatioBased(settings.sample_ratio)), f"{settings.service_name}-{component}"
    provider = TracerProvider(resource=Resource.create({"service.name": name}), shutdown_on_exit=True, sampler=sampler)
    endpoint = settings.otlp_endpoint.rstrip("/") + "/v1/traces"
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
    return Tracing(provider.get_tracer(f"loraplex.{component}"), provider)


def _edge_sampler(ratio: float, rng: random.Random) -> Any:
    """The gateway's sampler: `ratio` of its requests' traces, a caller's traceparent (a remote parent,
    sampled or not) counting for nothing; the spans under a request's own span follow that span."""
    from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

    class OwnDraw(TraceIdRatioBased):
        """`ratio` by a number drawn here: the trace id may be the caller's, chosen to pass any ratio."""

        def should_sample(self, parent_context, trace_id, *args, **kwargs):
            return super().should_sample(parent_context, rng.getrandbits(64), *args, **kwargs)

        def get_description(self) -> str:
            return f"OwnDraw{{{self.rate}}}"

    own = OwnDraw(ratio)
    return ParentBased(own, remote_parent_sampled=own, remote_parent_not_sampled=own)


def traceparent_of(span: trace.Span) -> str | None:
    """`span`'s W3C traceparent header value (None for a span that is not recorded)."""
    if not span.is_recording():
        return None
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier, trace.set_span_in_context(span))
    return carrier.get("traceparent")


def context_of(traceparent: str | None, tracestate: str | None = None) -> Context:
    """The trace context W3C headers name (an empty one for None or a malformed traceparent)."""
    headers = {"traceparent": traceparent, "tracestate": tracestate}
    return _PROPAGATOR.extract({name: value for name, value in headers.items() if value})
