"""Traces across the gateway and its workers (OpenTelemetry; torch-free): the deployment's
`tracing` settings, the tracer each process opens from them, and the W3C trace context a
`WorkerCall` carries from the gateway's span to the worker's.

Here, below both, because a worker runs in a process of its own (a Ray actor) and exports its
spans itself: it gets these settings in its `WorkerSpec`. Off (no `otlp_endpoint`), a process's
tracer is OpenTelemetry's no-op one and the SDK is not even imported.
"""

from __future__ import annotations

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
    sample_ratio: float = 1.0  # of the traces that start here; a caller's traceparent decides for its own

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


def open_tracing(settings: TracingSettings, component: str) -> Tracing:
    """A tracer that exports over OTLP/HTTP in batches, off the caller's thread; a no-op one when off."""
    if not settings.is_enabled:
        return Tracing(trace.NoOpTracer())
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor
    from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

    name = settings.service_name if component == "gateway" else f"{settings.service_name}-{component}"
    provider = TracerProvider(resource=Resource.create({"service.name": name}), shutdown_on_exit=True,
                              sampler=ParentBased(TraceIdRatioBased(settings.sample_ratio)))
    endpoint = settings.otlp_endpoint.rstrip("/") + "/v1/traces"
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
    return Tracing(provider.get_tracer(f"loraplex.{component}"), provider)


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
