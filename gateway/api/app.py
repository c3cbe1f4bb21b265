"""The HTTP API (SPEC §6) as a FastAPI app over a `Gateway` (torch-free).

The app is built once per process; `app.state.gateway` is set by whoever runs
it (the Ray Serve ingress, or a test). Every error is the OpenAI error shape
with its status; a bad request never reaches a worker, and no answer carries a
stack trace or an internal id. A tenant's request counts against its rate
limit as soon as it is authenticated, before its body is read. Large prompts
are tokenized off the event loop, and text too long to fit the context is
refused before tokenizing.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import BaseModel

from gateway.admission import Prepared
from gateway.api.adapters import UPLOAD_BODY, LoadLoRARequest, UnloadLoRARequest, add_adapter_routes
from gateway.api.formats import (
    ChatFormatter,
    CompletionFormatter,
    LlamaFormatter,
    sse,
    summary,
    token_str,
    tokenize_piece,
)
from gateway.api.llama_protocol import ApplyTemplateRequest, DetokenizeRequest, LlamaCompletionRequest, LoraScale, TokenizeRequest
from gateway.api.protocol import APIError, ChatRequest, CompletionRequest, load_json, parse, read_body
from gateway.api.sampling import compiled_grammar, llama_params, openai_params, settings_of
from gateway.api.tools import ToolPlan, chat_input, rendered_size
from gateway.dispatch import Gateway
from gateway.metrics import adapter_label
from gateway.tenants import Tenant
from worker.contract.calls import Delta
from worker.formats.chat_template import ChatTemplateError, encode_chat, render_chat
from worker.formats.tokenizer import TokenizerError

log = logging.getLogger(__name__)
OFF_LOOP_CHARS = 4096  # texts longer than this are tokenized in a worker thread
OFF_LOOP_TOKENS = 4096  # token lists longer than this are decoded in a worker thread


async def _json_body(request: Request, gateway: Gateway) -> Any:
    return load_json(await read_body(request, gateway.config.http.max_body_bytes))


def _headers(prepared: Prepared) -> dict[str, str]:
    return {"x-loraplex-shard": prepared.route.get("shard", ""), "x-loraplex-replica": prepared.route.get("replica", "")}


class _Timing:
    def __init__(self, gateway: Gateway, tenant: Tenant, prepared: Prepared | None, endpoint: str) -> None:
        self.gateway, self.tenant, self.endpoint = gateway, tenant, endpoint
        self.adapter = adapter_label(prepared.scales) if prepared else "base"
        self.started, self.first = time.perf_counter(), None

    def token(self) -> None:
        if self.first is None:
            self.first = time.perf_counter()

    def done(self, status: int, final: Delta | None) -> None:
        now = time.perf_counter()
        self.gateway.metrics.finished(self.tenant.id, self.adapter, self.endpoint, status, now - self.started,
                                      None if self.first is None else self.first - self.started, final)


async def _respond(gateway: Gateway, prepared: Prepared, stream: bool, endpoint: str, whole, chunk, usage_chunk=None,
                   include_usage: bool = False, done_marker: bool = True) -> Response:
    timing = _Timing(gateway, prepared.tenant, prepared, endpoint)
    in_flight = gateway.metrics.in_flight.labels(prepared.tenant.id)
    in_flight.inc()
    if not stream:
        try:
            deltas = await gateway.collect(prepared, on_first=timing.token)
        except APIError as e:
            timing.done(e.status, None)
            raise
        finally:
            in_flight.dec()
        timing.done(200, summary([d for d in deltas if d.finish_reason is not None]))
        return JSONResponse(whole(deltas), headers=_headers(prepared))
    deltas = gateway.stream(prepared)
    try:
        first = await anext(deltas)  # errors before the first token are still HTTP errors
    except BaseException as e:
        in_flight.dec()
        timing.done(e.status if isinstance(e, APIError) else 500, None)
        raise

    async def events() -> AsyncIterator[bytes]:
        finals: list[Delta] = []  # each choice's last delta
        status, started = 200, set()
        try:
            delta = first
            while True:
                timing.token()
                if delta.finish_reason == "error":
                    error = gateway.error_of(delta, prepared)
                    status = error.status
                    yield sse(error.body())
                    break
                out = chunk(delta, delta.index not in started)  # a chunk, or several (tool calls)
                for piece in out if isinstance(out, list) else [out]:
                    yield sse(piece)
                started.add(delta.index)
                if delta.finish_reason is not None:
                    finals.append(delta)
                if delta.is_finished:
                    if include_usage and usage_chunk is not None:
                        yield sse(usage_chunk(finals))
                    break
                delta = await anext(deltas)
            if done_marker:
                yield sse("[DONE]")
        finally:
            await deltas.aclose()  # a client that went away cancels the worker's request
            in_flight.dec()
            timing.done(status, summary(finals) if finals and status == 200 else None)

    return StreamingResponse(events(), media_type="text/event-stream", headers=_headers(prepared))


_process_gateway: list[Gateway] = []  # the gateway of this process (Ray Serve's ingress replica)


def set_process_gateway(gateway: Gateway) -> None:
    _process_gateway[:] = [gateway]


def process_gateway() -> Gateway:
    if not _process_gateway:
        raise APIError(503, "the gateway is still starting", "starting")
    return _process_gateway[0]


BODIES: dict[str, Any] = {  # what each POST takes, for the OpenAPI document (parsed by hand, with our error shape)
    "/v1/completions": CompletionRequest,
    "/v1/chat/completions": ChatRequest,
    "/completion": LlamaCompletionRequest,
    "/lora-adapters": list[LoraScale],
    "/tokenize": TokenizeRequest,
    "/detokenize": DetokenizeRequest,
    "/apply-template": ApplyTemplateRequest,
    "/v1/load_lora_adapter": LoadLoRARequest,
    "/v1/unload_lora_adapter": UnloadLoRARequest,
}


def create_app(current: Callable[[], Gateway] | None = None) -> FastAPI:
    """The app over the Gateway `current()` returns (default: `app.state.gateway`, set
    before serving). Ray Serve builds it in the replica and sets the gateway there."""
    app = FastAPI(title="loraplex", docs_url=None, redoc_url=None)

    def _gateway(request: Request) -> Gateway:
        return current() if current is not None else app.state.gateway

    async def _begin(request: Request, model: type | None = None) -> tuple[Gateway, Tenant, Any]:
        """The gateway, the calling tenant (its request counted against its rate), and the parsed body (when `model`)."""
        gateway = _gateway(request)
        gateway.registry.ensure_running()
        tenant = gateway.tenants.authenticate(request.headers.get("authorization"))
        await gateway.limiter.admit(tenant)
        await gateway.registry.refresh_if_stale()
        return gateway, tenant, None if model is None else parse(model, await _json_body(request, gateway))

    async def _off_loop(gateway: Gateway, size: int, work: Callable[[], Any]) -> Any:
        """Tokenizing or rendering: refused when the text cannot fit the context; off the event loop when large."""
        if size > gateway.catalog.max_prompt_chars:
            raise APIError(400, f"the prompt ({size} characters) cannot fit the model's context of {gateway.catalog.max_positions} tokens",
                           "context_length_exceeded")
        try:
            return await asyncio.to_thread(work) if size > OFF_LOOP_CHARS else work()
        except (TokenizerError, ChatTemplateError) as e:
            raise APIError(400, str(e), "invalid_prompt") from e

    async def _tokens(gateway: Gateway, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, list):
            return prompt
        tokenizer = gateway.catalog.tokenizer  # raw prompts parse special tokens, as llama.cpp does
        return await _off_loop(gateway, len(prompt), lambda: tokenizer.encode(prompt, add_special=True, parse_special=True))

    def _chat_input(gateway: Gateway, body) -> tuple[ToolPlan | None, list[dict[str, Any]], dict[str, Any]]:
        try:
            return chat_input(body, gateway.catalog.tool_style)
        except ValueError as e:
            raise APIError(400, str(e), "invalid_value") from e

    def _adapters(gateway: Gateway, tenant: Tenant) -> list[dict[str, Any]]:
        out = []
        for i, (name, info) in enumerate(gateway.admission.adapters(tenant).items()):
            entry = {"id": i, "name": name, "path": info.path.name, "scale": tenant.default_scales.get(name, 0.0),
                     "task_name": info.task_name, "prompt_prefix": info.prompt_prefix}
            if info.is_alora:
                entry["alora_invocation_tokens"] = list(info.invocation_tokens)
                entry["alora_invocation_string"] = "".join(token_str(gateway.catalog.tokenizer, t) for t in info.invocation_tokens)
            out.append(entry)
        return out

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(Exception)
    async def _internal(request: Request, e: Exception) -> JSONResponse:  # never a stack trace to a client
        log.error("internal error on %s %s", request.method, request.url.path, exc_info=e)
        return JSONResponse(APIError(500, "internal error", "internal_error").body(), status_code=500)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        gateway, tenant, body = await _begin(request, CompletionRequest)
        scales = gateway.admission.resolve_scales(tenant, body.model, body.lora)
        tokenizer, prompt = gateway.catalog.tokenizer, await _tokens(gateway, body.prompt)
        grammar = await compiled_grammar(gateway, body, "response_format")
        ranked = body.num_samples > body.n  # best_of: every sample's token log-probabilities rank them
        logprobs = body.logprobs if body.logprobs is not None or not ranked else 0
        echo = body.echo and body.logprobs is not None  # the worker computes the prompt's log-probabilities only when asked
        params = openai_params(gateway, len(prompt), body.max_tokens, body, logprobs, echo, grammar, body.num_samples)
        prepared = await gateway.admission.prepare(tenant, prompt, params, scales, body.cache_salt, timeout_s=body.timeout_s)
        fmt = CompletionFormatter(tokenizer, body.model or gateway.catalog.model_name, prompt, body.echo, body.logprobs,
                                  keep=body.n if ranked else None)
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return await _respond(gateway, prepared, body.stream, "completions", fmt.whole, fmt.chunk, fmt.usage_chunk, include_usage)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        gateway, tenant, body = await _begin(request, ChatRequest)
        scales = gateway.admission.resolve_scales(tenant, body.model, body.lora)
        tools, messages, extra = _chat_input(gateway, body)
        size = rendered_size(messages, extra)
        prompt = await _off_loop(gateway, size, lambda: encode_chat(gateway.catalog.tokenizer, messages, **extra))
        k = (body.top_logprobs or 0) if body.logprobs else None
        grammar = await compiled_grammar(gateway, body, "response_format", tools)
        params = openai_params(gateway, len(prompt), body.token_limit, body, k, grammar=grammar, n=body.n)
        prepared = await gateway.admission.prepare(tenant, prompt, params, scales, body.cache_salt, timeout_s=body.timeout_s)
        fmt = ChatFormatter(gateway.catalog.tokenizer, body.model or gateway.catalog.model_name, k, tools)
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return await _respond(gateway, prepared, body.stream, "chat", fmt.whole, fmt.chunk, fmt.usage_chunk, include_usage)

    @app.post("/completion")
    async def llama_complete(request: Request) -> Response:
        gateway, tenant, body = await _begin(request, LlamaCompletionRequest)
        scales = gateway.admission.resolve_scales(tenant, None, body.lora)
        model, prompt = gateway.catalog.model_name, await _tokens(gateway, body.prompt)
        grammar = await compiled_grammar(gateway, body, "json_schema" if body.json_schema is not None else "grammar")
        params = llama_params(gateway, len(prompt), body, grammar)
        prepared = await gateway.admission.prepare(tenant, prompt, params, scales, body.cache_salt, body.cache_prompt, body.timeout_s)

        settings = {**settings_of(params, stream=body.stream), "lora": [{"id": i, "scale": scales[n]} for i, n in enumerate(
            gateway.admission.adapter_names(tenant)) if n in scales]}
        fmt = LlamaFormatter(gateway.catalog.tokenizer, model, prompt, settings, body.return_tokens)
        return await _respond(gateway, prepared, body.stream, "completion", fmt.whole, fmt.chunk, done_marker=False)

    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict[str, Any]:
        gateway, _, body = await _begin(request, TokenizeRequest)
        tokenizer = gateway.catalog.tokenizer

        def work() -> list:
            ids = tokenizer.encode(body.content, add_special=body.add_special, parse_special=body.parse_special)
            return ids if not body.with_pieces else [tokenize_piece(tokenizer, t) for t in ids]

        return {"tokens": await _off_loop(gateway, len(body.content), work)}

    @app.post("/detokenize")
    async def detokenize(request: Request) -> dict[str, Any]:
        gateway, _, body = await _begin(request, DetokenizeRequest)
        vocab = gateway.catalog.tokenizer.vocab_size
        bad = [t for t in body.tokens if not 0 <= t < vocab]
        if bad:
            raise APIError(400, f"token id {bad[0]} is out of range (vocabulary size {vocab})", "invalid_value")
        decode = functools.partial(gateway.catalog.tokenizer.decode, body.tokens, skip_special=False)
        return {"content": await asyncio.to_thread(decode) if len(body.tokens) > OFF_LOOP_TOKENS else decode()}

    @app.post("/apply-template")
    async def apply_template(request: Request) -> dict[str, Any]:
        gateway, _, body = await _begin(request, ApplyTemplateRequest)
        _, messages, extra = _chat_input(gateway, body)
        size = rendered_size(messages, extra)
        return {"prompt": await _off_loop(gateway, size, lambda: render_chat(gateway.catalog.tokenizer, messages, **extra))}

    @app.get("/props")
    async def props(request: Request) -> dict[str, Any]:
        """llama-server's server properties, as the calling tenant sees them (no paths, no other tenant)."""
        gateway, tenant, _ = await _begin(request)
        catalog = gateway.catalog
        tokenizer = catalog.tokenizer
        defaults = llama_params(gateway, 1, LlamaCompletionRequest(prompt=[0]))  # what a /completion that sets nothing gets
        return {
            "default_generation_settings": {"n_ctx": catalog.max_positions, "params": settings_of(defaults)},
            "total_slots": gateway.config.engine.num_slots,  # per replica
            "model_path": catalog.model_name,
            "model_alias": catalog.model_name,
            "chat_template": tokenizer.chat_template or "",
            "bos_token": token_str(tokenizer, tokenizer.bos_id) if tokenizer.bos_id is not None else "",
            "eos_token": token_str(tokenizer, tokenizer.eos_id) if tokenizer.eos_id is not None else "",
            "modalities": {"vision": False, "audio": False},
            "build_info": "loraplex",
            "lora_adapters": len(gateway.admission.adapter_names(tenant)),
        }

    @app.get("/v1/models")
    async def models(request: Request) -> dict[str, Any]:
        gateway, tenant, _ = await _begin(request)
        base = gateway.catalog.model_name
        data = [{"id": base, "object": "model", "created": 0, "owned_by": "loraplex"}]
        data += [{"id": n, "object": "model", "created": 0, "owned_by": "loraplex", "parent": base} for n in gateway.admission.adapter_names(tenant)]
        return {"object": "list", "data": data}

    @app.get("/lora-adapters")
    async def list_adapters(request: Request) -> list[dict[str, Any]]:
        gateway, tenant, _ = await _begin(request)
        return _adapters(gateway, tenant)

    @app.post("/lora-adapters")
    async def set_adapters(request: Request) -> list[dict[str, Any]]:
        gateway, tenant, data = await _begin(request, list[LoraScale])
        names = gateway.admission.adapter_names(tenant)
        for entry in data:
            if entry.id >= len(names):
                raise APIError(404, f"adapter id {entry.id} not found (this key has {len(names)} adapters)", "adapter_not_found")
        tenant.default_scales = gateway.admission.enabled(tenant, {names[e.id]: e.scale for e in data})
        return _adapters(gateway, tenant)

    @app.get("/health")
    async def health(request: Request) -> JSONResponse:
        """Without a key: liveness only (the gateway answers). With the operator key: every
        shard and replica, and the cache's Redis state (503 when a shard has no healthy replica)."""
        gateway = _gateway(request)
        if request.headers.get("authorization") is None and not gateway.tenants.is_operator_open:
            return JSONResponse({"status": "ok"})
        gateway.tenants.authenticate_operator(request.headers.get("authorization"))
        report = await gateway.full_health()
        return JSONResponse(report, status_code=200 if report["status"] != "down" else 503)

    @app.get("/metrics")
    async def metrics(request: Request) -> PlainTextResponse:
        gateway = _gateway(request)
        gateway.tenants.authenticate_operator(request.headers.get("authorization"))
        return PlainTextResponse(await gateway.full_metrics(), media_type="text/plain; version=0.0.4")

    add_adapter_routes(app, _gateway, _begin)
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
            for path, body in BODIES.items():
                is_list = getattr(body, "__origin__", None) is list
                model: type[BaseModel] = body.__args__[0] if is_list else body
                definition = model.model_json_schema(ref_template="#/components/schemas/{model}")
                schemas.update(definition.pop("$defs", {}))
                schemas[model.__name__] = definition
                ref = {"$ref": f"#/components/schemas/{model.__name__}"}
                schema["paths"][path]["post"]["requestBody"] = {
                    "required": True, "content": {"application/json": {"schema": {"type": "array", "items": ref} if is_list else ref}},
                }
            schema["paths"]["/v1/adapters"]["post"]["requestBody"] = UPLOAD_BODY
            components["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
            schema["security"] = [{"bearer": []}]
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi
