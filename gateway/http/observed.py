"""Every HTTP request as observability sees it (torch-free): its server span, the child of the
caller's W3C `traceparent` when it sends one, sampled by the gateway's own ratio whatever the caller's
flag says (worker/contract/tracing.py; the request path records its own spans under it:
gateway/requests/tracing.py), and its answer counted once in `loraplex_gateway_requests_total`
(gateway/metrics.py): respond()'s Timing counts the requests it answers, this the rest, those
refused before they reached a worker included, under the caller's tenant when its key names one."""

from __future__ import annotations

import time
from typing import Any

from fastapi import Request
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from gateway.compose import Gateway
from gateway.errors import GatewayError
from gateway.http.incoming import credentials
from gateway.requests.tracing import arrived, context_of, reset_arrived

ENDPOINTS = {"/v1/completions": "completions", "/v1/chat/completions": "chat", "/completion": "completion",  # respond()'s names
             "/completions": "completion", "/v1/messages": "messages", "/v1/responses": "responses",
             "/responses": "responses"}
NO_ROUTE = ""  # the endpoint of a request no route took (a 404): never the path a client sent


def endpoint_of(scope: dict[str, Any]) -> str:
    """The metric label of the route that took the request: respond()'s name for it, else its path template."""
    route = scope.get("route")
    path = getattr(route, "path", None)
    return NO_ROUTE if path is None else ENDPOINTS.get(path, path)


def tenant_of(gateway: Gateway, scope: dict[str, Any]) -> str:
    """The tenant the request's key names: as incoming.begin noted it, else (a route that never asked: no
    such route, /health) looked up here; "" without one (a 401, the operator's key)."""
    noted = scope.get("state", {}).get("tenant_id")
    if noted is not None:
        return noted
    try:
        return gateway.tenants.authenticate(credentials(Request(scope))).id
    except GatewayError:
        return ""


class ObservedRequests:
    """ASGI middleware: each HTTP request traced and counted (the module's docstring)."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        try:
            gateway: Gateway = scope["app"].state.find_gateway()
        except (GatewayError, AttributeError):  # still starting: nothing to count in yet
            return await self.app(scope, receive, send)
        status = 500  # unless an answer starts

        async def sending(message: dict[str, Any]) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        headers = {name.decode("latin-1"): value.decode("latin-1") for name, value in scope["headers"]
                   if name in (b"traceparent", b"tracestate")}
        span = gateway.tracing.tracer.start_span(scope["method"], context_of(headers.get("traceparent"), headers.get("tracestate")),
                                                 SpanKind.SERVER, {"http.request.method": scope["method"], "url.path": scope["path"]})
        attached = otel_context.attach(trace.set_span_in_context(span))
        arrival = arrived(time.time_ns())
        try:
            with gateway.metrics.answering():
                try:
                    await self.app(scope, receive, sending)
                finally:  # unless respond()'s Timing counted it
                    gateway.metrics.answered(endpoint_of(scope), status, lambda: tenant_of(gateway, scope))
        finally:
            reset_arrived(arrival)
            otel_context.detach(attached)
            if span.is_recording():
                route = getattr(scope.get("route"), "path", None)
                if route is not None:
                    span.update_name(f"{scope['method']} {route}")
                    span.set_attribute("http.route", route)
                span.set_attribute("http.response.status_code", status)
                if status >= 500:
                    span.set_status(Status(StatusCode.ERROR))
            span.end()
