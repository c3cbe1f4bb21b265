"""A request's trace, exported over the wire (OTLP/HTTP) to a receiver started here: the gateway's
spans under the caller's traceparent, the worker's under the gateway's route span (in-process
workers, with their own exporter, as a Ray replica has), and failover as a second route span.
Sampling is the gateway's own ratio, never a caller's sampled flag."""

from __future__ import annotations

import gzip
import random
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest, ExportTraceServiceResponse
from opentelemetry.proto.trace.v1.trace_pb2 import Status

from gateway.cluster.pool import WorkerFailed
from tests.gateway.gateway_setup import PROMPT, auth, local_serving, tiny_config
from tests.gateway.live_server import live_server, wait_until
from worker.contract.tracing import TracingSettings, context_of, open_tracing

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CALLER_SPAN_ID = "00f067aa0ba902b7"
WORKER_SPANS = ("worker.request", "worker.queue", "worker.prefill", "worker.decode")


@dataclass(frozen=True)
class ReceivedSpan:
    service: str
    name: str
    trace_id: str
    span_id: str
    parent_id: str
    attributes: dict[str, Any]
    start_ns: int
    end_ns: int
    is_error: bool


class Receiver(ThreadingHTTPServer):
    """An OTLP/HTTP trace receiver: POST /v1/traces, protobuf."""

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.spans: list[ReceivedSpan] = []
        self.url = f"http://127.0.0.1:{self.server_address[1]}"


class _Handler(BaseHTTPRequestHandler):
    def do_POST(self) -> None:  # noqa: N802 (http.server's name)
        body = self.rfile.read(int(self.headers["Content-Length"]))
        if self.headers.get("Content-Encoding") == "gzip":
            body = gzip.decompress(body)
        if self.path != "/v1/traces":
            self.send_error(404)
            return
        request = ExportTraceServiceRequest.FromString(body)
        for resource_spans in request.resource_spans:
            service = _attributes(resource_spans.resource.attributes)["service.name"]
            for scope_spans in resource_spans.scope_spans:
                self.server.spans.extend(
                    ReceivedSpan(service, s.name, s.trace_id.hex(), s.span_id.hex(), s.parent_span_id.hex(), _attributes(s.attributes),
                                 s.start_time_unix_nano, s.end_time_unix_nano, s.status.code == Status.STATUS_CODE_ERROR)
                    for s in scope_spans.spans)
        answer = ExportTraceServiceResponse().SerializeToString()
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", str(len(answer)))
        self.end_headers()
        self.wfile.write(answer)

    def log_message(self, *args: Any) -> None:
        pass


def _attributes(pairs) -> dict[str, Any]:
    return {kv.key: getattr(kv.value, kv.value.WhichOneof("value")) for kv in pairs}


@pytest.fixture(scope="module")
def receiver() -> Iterator[Receiver]:
    server = Receiver()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


def serving(tiny_llama, tmp_path_factory, receiver, **tracing):
    prefix = f"loraplex-test-{uuid.uuid4().hex}"
    tracing = {"otlp_endpoint": receiver.url, "service_name": "lp-test", **tracing}
    config = tiny_config(tiny_llama, tmp_path_factory.mktemp("traced"), prefix, tracing=tracing)
    with local_serving(config) as (app, pool), live_server(app) as url:
        yield url, app.state.gateway, pool


@pytest.fixture(scope="module")
def traced(tiny_llama, tmp_path_factory, receiver):
    yield from serving(tiny_llama, tmp_path_factory, receiver)


@pytest.fixture(scope="module")
def never_sampled(tiny_llama, tmp_path_factory, receiver):
    yield from serving(tiny_llama, tmp_path_factory, receiver, sample_ratio=0.0)


def exported(receiver: Receiver, gateway, pool, trace_id: str, num_spans: int) -> dict[str, list[ReceivedSpan]]:
    """The trace's spans by name, once the gateway and every worker exported them."""
    for tracing in (gateway.tracing, *(worker.tracing for worker in pool.workers.values())):
        assert tracing.flush()
    assert wait_until(lambda: len([s for s in receiver.spans if s.trace_id == trace_id]) >= num_spans, 10)
    spans: dict[str, list[ReceivedSpan]] = {}
    for span in receiver.spans:
        if span.trace_id == trace_id:
            spans.setdefault(span.name, []).append(span)
    return spans


def test_a_request_is_traced_from_the_callers_traceparent_through_the_worker(traced, receiver) -> None:
    url, gateway, pool = traced
    headers = {**auth(), "traceparent": f"00-{TRACE_ID}-{CALLER_SPAN_ID}-01"}
    body = {"model": "a", "prompt": PROMPT, "max_tokens": 4, "ignore_eos": True}
    r = httpx.post(f"{url}/v1/completions", headers=headers, json=body, timeout=60)
    assert r.status_code == 200
    spans = exported(receiver, gateway, pool, TRACE_ID, 8)
    assert set(spans) == {"POST /v1/completions", "admission", "route", "queue", *WORKER_SPANS}
    (server,), (admission,), (route,), (queue,) = (spans[n] for n in ("POST /v1/completions", "admission", "route", "queue"))
    assert server.parent_id == CALLER_SPAN_ID and server.service == "lp-test" 
    assert not any(s.is_error for named in spans.values() for s in named)
    assert server.attributes["loraplex.tenant"] == "t1" and server.attributes["http.response.status_code"] == 200
    assert admission.parent_id == route.parent_id == server.span_id and queue.parent_id == route.span_id
    assert admission.attributes["loraplex.tenant"] == "t1" and admission.attributes["loraplex.prompt_tokens"] == len(PROMPT)
    assert route.attributes["loraplex.replica"] == r.headers["x-loraplex-replica"] and route.attributes["loraplex.attempt"] == 1
    worker = {name: spans[name][0] for name in WORKER_SPANS}
    assert {s.service for s in worker.values()} == {"lp-test-worker"}
    assert worker["worker.request"].parent_id == route.span_id  # across the WorkerCall's traceparent
    assert all(worker[name].parent_id == worker["worker.request"].span_id for name in WORKER_SPANS[1:])
    assert worker["worker.request"].attributes["loraplex.tenant"] == "t1"
    assert worker["worker.request"].attributes["loraplex.completion_tokens"] == 4
    queued, prefill, decode = (worker[name] for name in WORKER_SPANS[1:])
    assert queued.end_ns == prefill.start_ns <= prefill.end_ns == decode.start_ns < decode.end_ns
    assert server.start_ns <= admission.start_ns <= admission.end_ns <= route.start_ns <= queue.start_ns <= queue.end_ns <= server.end_ns


def test_a_failed_attempt_and_its_failover_are_two_route_spans(traced, receiver) -> None:
    url, gateway, pool = traced
    original, attempts = pool.stream, []

    async def failing_once(replica_id, call):
        attempts.append(replica_id)
        if len(attempts) == 1:
            raise WorkerFailed(f"replica {replica_id} died")
        async for delta in original(replica_id, call):
            yield delta

    trace_id = uuid.uuid4().hex
    pool.stream = failing_once
    try:
        body = {"model": "a", "prompt": PROMPT[:12], "max_tokens": 2}
        r = httpx.post(f"{url}/v1/completions", headers={**auth(), "traceparent": f"00-{trace_id}-{CALLER_SPAN_ID}-01"},
                       json=body, timeout=60)
    finally:
        pool.stream = original
        gateway.dispatcher._failed_until_s.clear()
    assert r.status_code == 200 and len(attempts) == 2
    routes = sorted(exported(receiver, gateway, pool, trace_id, 10)["route"], key=lambda s: s.attributes["loraplex.attempt"])
    assert [s.attributes["loraplex.replica"] for s in routes] == attempts
    assert [s.is_error for s in routes] == [True, False]
    assert routes[1].attributes["loraplex.replica"] == r.headers["x-loraplex-replica"]


def test_tracing_is_off_unless_configured() -> None:
    off = open_tracing(TracingSettings(), "gateway")
    assert not off.is_enabled and not off.tracer.start_span("x").is_recording()
    with pytest.raises(ValueError, match="sample_ratio"):
        TracingSettings(otlp_endpoint="http://collector:4318", sample_ratio=1.5)
    with pytest.raises(ValueError, match="otlp_endpoint"):
        TracingSettings(otlp_endpoint="collector:4318")


def test_a_callers_sampled_flag_does_not_force_a_trace(never_sampled, receiver) -> None:
    url, gateway, pool = never_sampled
    trace_ids = [uuid.uuid4().hex for _ in range(3)]
    for trace_id in trace_ids:
        headers = {**auth(), "traceparent": f"00-{trace_id}-{CALLER_SPAN_ID}-01"}
        r = httpx.post(f"{url}/v1/completions", headers=headers, json={"model": "a", "prompt": PROMPT[:12], "max_tokens": 2},
                       timeout=60)
        assert r.status_code == 200
    for tracing in (gateway.tracing, *(worker.tracing for worker in pool.workers.values())):
        assert tracing.flush()
    assert not [s for s in receiver.spans if s.trace_id in trace_ids]


def test_the_gateway_samples_by_its_own_ratio_whatever_the_callers_flag_and_trace_id(receiver) -> None:
    """A caller chooses its trace id: one whose low 64 bits are 0 passes any trace-id ratio; the gateway
    draws its own number instead. A worker follows its parent (the gateway's span) either way."""
    never = open_tracing(TracingSettings(otlp_endpoint=receiver.url, sample_ratio=0.0), "gateway")
    always = open_tracing(TracingSettings(otlp_endpoint=receiver.url, sample_ratio=1.0), "gateway")
    rarely = open_tracing(TracingSettings(otlp_endpoint=receiver.url, sample_ratio=0.01), "gateway", random.Random(0))
    worker = open_tracing(TracingSettings(otlp_endpoint=receiver.url, sample_ratio=0.0), "worker")
    sampled, unsampled = (context_of(f"00-{'ab' * 8}{'0' * 16}-{CALLER_SPAN_ID}-{flag}") for flag in ("01", "00"))
    try:
        assert not never.tracer.start_span("x", sampled).is_recording()
        assert always.tracer.start_span("x", unsampled).is_recording()
        assert sum(rarely.tracer.start_span("x", sampled).is_recording() for _ in range(1000)) < 50
        assert worker.tracer.start_span("x", sampled).is_recording()
        assert not worker.tracer.start_span("x", unsampled).is_recording()
    finally:
        for tracing in (never, always, rarely, worker):
            tracing.close()
