"""The HTTP app over a `Gateway` (torch-free): every API package in `APIS` (its routers, bodies and
error shape), the errors they answer, CORS, and the OpenAPI document. Adding an API is a package
under gateway/api/ and a line in `APIS`.

The app is built once per process; `app.state.gateway` is set by whoever runs it (the Ray
Serve ingress, or a test). Every error is the OpenAI error shape with its status; a bad request
never reaches a worker, and no answer carries a stack trace or an internal id.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException

from gateway.api import admin, anthropic, llama, openai, responses
from gateway.compose import Gateway
from gateway.errors import GatewayError
from gateway.http.api import Api
from gateway.http.cors import Cors
from gateway.http.errors import openai_error
from gateway.http.observed import ObservedRequests
from gateway.http.uploads import UPLOAD_BODY
from gateway.registry.records import RegistryUnavailable

log = logging.getLogger(__name__)

_process_gateway: list[Gateway] = []  # the gateway of this process (Ray Serve's ingress replica)


def set_process_gateway(gateway: Gateway) -> None:
    _process_gateway[:] = [gateway]


def process_gateway() -> Gateway:
    if not _process_gateway:
        raise GatewayError(503, "the gateway is still starting", "starting")
    return _process_gateway[0]


APIS: tuple[Api, ...] = (openai.API, llama.API, admin.API, anthropic.API, responses.API)  # every API the app serves


def error_response(request: Request, e: GatewayError) -> JSONResponse:
    """`e` in the shape of the API the request was for (OpenAI's, unless an API claims the path)."""
    shape = next((api.error_shape for api in APIS if api.answers(request.url.path)), openai_error)
    return JSONResponse(shape(e), status_code=e.status, headers=e.headers)


async def _api_error(request: Request, e: GatewayError) -> JSONResponse:
    return error_response(request, e)


async def _http_error(request: Request, e: HTTPException) -> JSONResponse:
    """Starlette's own answers (no such route, a method the route does not take) in the API's shape."""
    if e.status_code == 404:
        error = GatewayError(404, f"no route {request.method} {request.url.path}", "not_found")
    elif e.status_code == 405:
        error = GatewayError(405, f"{request.url.path} does not take {request.method}", "method_not_allowed")
    else:
        error = GatewayError(e.status_code, str(e.detail), None)
    return error_response(request, GatewayError(error.status, error.message, error.code, dict(e.headers or {})))


async def _registry_unavailable(request: Request, e: RegistryUnavailable) -> JSONResponse:
    """While the registry's Redis is down, changes wait for it (serving goes on)."""
    return error_response(request, GatewayError(
        503, "the adapter registry is unavailable (its Redis cannot be reached): try again shortly",
        "registry_unavailable", {"Retry-After": "5"}))


async def _internal(request: Request, e: Exception) -> JSONResponse:  # never a stack trace to a client
    log.error("internal error on %s %s", request.method, request.url.path, exc_info=e)
    return error_response(request, GatewayError(500, "internal error", "internal_error"))


class ConfiguredCORS:
    """CORS (gateway/http/cors.py) for the gateway's `http.cors_origins` and `http.cors_credentials`, built at
    the first request: the app is made before its gateway (the Serve ingress sets it)."""

    def __init__(self, app: Any) -> None:
        self.app, self._inner = app, None

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if self._inner is None and scope["type"] == "http":
            try:
                config = scope["app"].state.find_gateway().config
            except (GatewayError, AttributeError):  # still starting: no CORS yet
                return await self.app(scope, receive, send)
            http = config.http  # several tenants, or a way to make more (a tenants file, an operator key)
            is_multi_tenant = len(config.tenants) > 1 or bool(config.tenants_file or config.operator_key_sha256
                                                               or config.operator_key_file)
            is_any_credentialed = http.cors_credentials or (http.cors_credentials is None and not is_multi_tenant)
            self._inner = Cors(self.app, http.cors_origins, http.cors_credentials is not False, is_any_credentialed)
        await (self._inner or self.app)(scope, receive, send)


def create_app(current: Callable[[], Gateway] | None = None) -> FastAPI:
    """The app over the Gateway `current()` returns (default: `app.state.gateway`, set
    before serving). Ray Serve builds it in the replica and sets the gateway there."""
    app = FastAPI(title="loraplex", docs_url=None, redoc_url=None)
    app.state.find_gateway = current if current is not None else lambda: app.state.gateway  # read per request
    app.add_exception_handler(GatewayError, _api_error)
    app.add_exception_handler(HTTPException, _http_error)
    app.add_exception_handler(Exception, _internal)
    app.add_exception_handler(RegistryUnavailable, _registry_unavailable)
    for api in APIS:
        for router in api.routers:
            app.include_router(router)
    app.add_middleware(ConfiguredCORS)
    app.add_middleware(ObservedRequests)  # outermost: every answer traced and counted, CORS' too
    _document_bodies(app)
    return app


def _document_bodies(app: FastAPI) -> None:
    """The OpenAPI document with every POST's body schema (the routes parse bodies themselves, to
    answer errors in the OpenAI shape), and the bearer key, so clients and fuzzers see them."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version="1", routes=app.routes)
            components = schema.setdefault("components", {})
            schemas = components.setdefault("schemas", {})
            for path, body in (item for api in APIS for item in api.bodies.items()):
                is_list = getattr(body, "__origin__", None) is list
                model: type[BaseModel] = body.__args__[0] if is_list else body
                definition = model.model_json_schema(ref_template="#/components/schemas/{model}")
                schemas.update(definition.pop("$defs", {}))
                schemas[model.__name__] = definition
                ref = {"$ref": f"#/components/schemas/{model.__name__}"}
                content = {"application/json": {"schema": {"type": "array", "items": ref} if is_list else ref}}
                schema["paths"][path]["post"]["requestBody"] = {"required": True, "content": content}
            schema["paths"]["/v1/adapters"]["post"]["requestBody"] = UPLOAD_BODY
            components["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
            schema["security"] = [{"bearer": []}]
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi
