"""llama-server's API (docs/api.md#llama-server; torch-free): `/completion` (and `/completions`), `/tokenize`,
`/detokenize`, `/apply-template`, `/props`, `/slots` and `/lora-adapters`, as the calling tenant
sees the server: its adapters only (ids are positions in its list), no paths, no other tenant's
requests."""

from __future__ import annotations

import asyncio
import functools
import json
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from gateway.api.llama.formats import LlamaFormatter, tokenize_piece
from gateway.api.llama.protocol import (
    ApplyTemplateRequest,
    DetokenizeRequest,
    LlamaCompletionRequest,
    LoraScale,
    Piece,
    TokenizeRequest,
)
from gateway.api.llama.sampling import llama_params, settings_of
from gateway.catalog import Catalog
from gateway.errors import GatewayError
from gateway.http.formatting import PromptProgress, TokenTimings, token_str
from gateway.http.incoming import begin, chat_rendering, off_loop
from gateway.http.parts import AdmissionPart, CatalogPart, ConfigPart, DispatcherPart, ResponderPart
from gateway.http.reasoning import reasoning_text
from gateway.http.respond import Responder, respond, route_headers
from gateway.http.sampling import compiled_grammar
from gateway.requests.admission import Admission, Prepared
from gateway.tenancy.tenants import Tenant

OFF_LOOP_TOKENS = 4096  # token lists longer than this are decoded in a worker thread

router = APIRouter()


@router.post("/completion")
@router.post("/completions")  # llama-server's other name for it: the same body and answer
async def llama_complete(request: Request, catalog: CatalogPart, admission: AdmissionPart, responder: ResponderPart) -> Response:
    """One prompt's answer, or a batch's: a JSON array, one answer a prompt, in order (each prompt a
    request of its own, run at once)."""
    tenant, body = await begin(request, LlamaCompletionRequest)
    prompts = body.prompts()
    if body.stream and len(prompts) > 1:
        raise GatewayError(400, f"a batch of {len(prompts)} prompts cannot be streamed: stream one prompt a request, "
                       "or send the batch without stream", "invalid_value")
    scales_by_name = admission.resolve_scales(tenant, None, body.lora)
    grammar = await compiled_grammar(catalog, body, "json_schema" if body.json_schema is not None else "grammar")
    lora = [{"id": i, "scale": scales_by_name[name]}
            for i, name in enumerate(admission.adapter_names(tenant)) if name in scales_by_name]
    runs = []
    for index, pieces in enumerate(prompts):
        prompt_ids = await _prompt_ids(catalog, pieces)
        params = llama_params(admission, catalog, len(prompt_ids), body, grammar)
        prepared = await admission.prepare(tenant, prompt_ids, params, scales_by_name, body.cache_salt,
                                                   body.cache_prompt, body.timeout_s)
        settings = {**settings_of(params, is_streamed=body.stream), "lora": lora, "timings_per_token": body.timings_per_token}
        progress = PromptProgress(len(prompt_ids)) if body.return_progress and body.stream else None
        timings = TokenTimings(len(prompt_ids)) if body.timings_per_token and body.stream else None
        formatter = LlamaFormatter(catalog.tokenizer, catalog.model_name, prompt_ids, settings,
                                   body.return_tokens, index, body.response_fields, progress, timings)
        runs.append((prepared, formatter))
    if len(runs) == 1:
        prepared, formatter = runs[0]
        return await respond(responder, prepared, "completion", formatter, body.stream, done_marker=False)
    return await _whole_batch(responder, runs)


async def _prompt_ids(catalog: Catalog, pieces: list[Piece], add_special: bool = True,
                      parse_special: bool = True) -> list[int]:
    """A prompt's token ids: its text pieces tokenized (special tokens parsed, as llama.cpp does, and
    the BOS added only when the prompt starts with text), its token ids kept."""
    tokenizer = catalog.tokenizer

    def work() -> list[int]:
        ids: list[int] = []
        for i, piece in enumerate(pieces):
            is_text = isinstance(piece, str)
            ids += tokenizer.encode(piece, add_special=add_special and i == 0,
                                    parse_special=parse_special) if is_text else [piece]
        return ids

    return await off_loop(catalog, sum(len(p) for p in pieces if isinstance(p, str)), work)


async def _whole_batch(responder: Responder, runs: list[tuple[Prepared, LlamaFormatter]]) -> Response:
    """A batch's answers as one JSON array; a failure fails the batch, once every prompt has ended (each
    is counted as it ran: a prompt cut short would use the worker and bill nothing)."""
    tasks = [asyncio.ensure_future(respond(responder, prepared, "completion", formatter, False))
             for prepared, formatter in runs]
    try:
        answers = await asyncio.gather(*tasks, return_exceptions=True)
    except BaseException:  # this request itself cancelled (the client left): so are its prompts
        for task in tasks:
            task.cancel()
        raise
    failure = next((a for a in answers if isinstance(a, BaseException)), None)
    if failure is not None:
        raise failure
    headers = {name: ",".join(dict.fromkeys(a.headers.get(name, "") for a in answers))
               for name in route_headers(runs[0][0])}
    return JSONResponse([json.loads(a.body) for a in answers], headers=headers)


@router.post("/tokenize")
async def tokenize(request: Request, catalog: CatalogPart) -> dict[str, Any]:
    _, body = await begin(request, TokenizeRequest)
    tokenizer = catalog.tokenizer
    _in_vocabulary(tokenizer.vocab_size, [p for p in body.pieces() if isinstance(p, int)])
    ids = await _prompt_ids(catalog, body.pieces(), body.add_special, body.parse_special)
    if not body.with_pieces:
        return {"tokens": ids}
    return {"tokens": await off_loop(catalog, len(ids), lambda: [tokenize_piece(tokenizer, t) for t in ids])}


def _in_vocabulary(vocab_size: int, ids: list[int]) -> None:
    out_of_range = [t for t in ids if not 0 <= t < vocab_size]
    if out_of_range:
        raise GatewayError(400, f"token id {out_of_range[0]} is out of range (vocabulary size {vocab_size})",
                           "invalid_value")


@router.post("/detokenize")
async def detokenize(request: Request, catalog: CatalogPart) -> dict[str, Any]:
    _, body = await begin(request, DetokenizeRequest)
    _in_vocabulary(catalog.tokenizer.vocab_size, body.tokens)
    decode = functools.partial(catalog.tokenizer.decode, body.tokens, skip_special=False)
    return {"content": await asyncio.to_thread(decode) if len(body.tokens) > OFF_LOOP_TOKENS else decode()}


@router.post("/apply-template")
async def apply_template(request: Request, catalog: CatalogPart, admission: AdmissionPart) -> dict[str, Any]:
    """The prompt a chat with this body would run, as text: with the template its adapters carry (or
    its own, where allowed) and an aLoRA's invocation (gateway/chat_templates.py)."""
    tenant, body = await begin(request, ApplyTemplateRequest)
    scales_by_name = admission.resolve_scales(tenant, body.model, body.lora)
    return {"prompt": await reasoning_text(catalog, body, chat_rendering(admission, tenant, scales_by_name, body))}


@router.get("/props")
async def props(request: Request, config: ConfigPart, catalog: CatalogPart, admission: AdmissionPart) -> dict[str, Any]:
    """llama-server's server properties, as the calling tenant sees them (no other tenant; the model's
    file by its name, not where it lies on the server)."""
    tenant, _ = await begin(request)
    tokenizer = catalog.tokenizer
    defaults = llama_params(admission, catalog, 1, LlamaCompletionRequest(prompt=[0]))  # what a /completion that sets nothing gets
    return {
        "default_generation_settings": {"n_ctx": catalog.max_positions, "params": settings_of(defaults)},
        "total_slots": config.engine.num_seq_slots,  # per replica
        "model_path": catalog.model_path.name,
        "model_alias": catalog.model_name,
        "chat_template": tokenizer.chat_template or "",
        "bos_token": token_str(tokenizer, tokenizer.bos_id) if tokenizer.bos_id is not None else "",
        "eos_token": token_str(tokenizer, tokenizer.eos_id) if tokenizer.eos_id is not None else "",
        "modalities": {"vision": False, "video": False, "audio": False},
        "endpoint_slots": True, "endpoint_props": True, "endpoint_metrics": True,  # /metrics: the operator's key
        "build_info": "loraplex",
        "is_sleeping": False,
        "lora_adapters": len(admission.adapter_names(tenant)),
    }


@router.get("/slots")
async def slots(request: Request, config: ConfigPart, catalog: CatalogPart, dispatcher: DispatcherPart) -> list[dict[str, Any]]:
    """llama-server's slot list as a gateway in front of several replicas can tell it: the sequence
    slots of every replica that takes requests now (ids run on from one replica to the next), as
    many of each busy as the gateway has requests in flight there. Which request a slot runs, its
    prompt and its parameters, are not said: it may be another tenant's. `?fail_on_no_slot=1`:
    503 when no slot is idle, as llama-server answers."""
    _, _ = await begin(request)
    n_ctx = catalog.max_positions
    listed: list[dict[str, Any]] = []
    for view in dispatcher.views():
        if not (view.is_healthy and view.is_reachable):
            continue
        num_busy = min(view.in_flight, view.num_seq_slots)
        listed += [{"id": len(listed) + i, "n_ctx": n_ctx, "speculative": False, "is_processing": i < num_busy}
                   for i in range(view.num_seq_slots)]
    if request.query_params.get("fail_on_no_slot") and all(slot["is_processing"] for slot in listed):
        raise GatewayError(503, "no slot available", "no_slot_available",
                       {"Retry-After": str(config.routing.busy_retry_after_s)})
    return listed


def _lora_adapters(admission: Admission, catalog: Catalog, tenant: Tenant) -> list[dict[str, Any]]:
    """The tenant's adapters with their default scales, as `/lora-adapters` lists them."""
    out = []
    for i, (name, info) in enumerate(admission.adapters(tenant).items()):
        listed = {"id": i, "name": name, "path": info.path.name, "scale": tenant.default_scales.get(name, 0.0),
                  "task_name": info.task_name, "prompt_prefix": info.prompt_prefix}
        if info.is_alora:
            listed["alora_invocation_tokens"] = list(info.invocation_tokens)
            listed["alora_invocation_string"] = "".join(token_str(catalog.tokenizer, t)
                                                        for t in info.invocation_tokens)
        out.append(listed)
    return out


@router.get("/lora-adapters")
async def list_adapters(request: Request, catalog: CatalogPart, admission: AdmissionPart) -> list[dict[str, Any]]:
    tenant, _ = await begin(request)
    return _lora_adapters(admission, catalog, tenant)


@router.post("/lora-adapters")
async def set_adapters(request: Request, admission: AdmissionPart, catalog: CatalogPart) -> list[dict[str, Any]]:
    tenant, lora_scales = await begin(request, list[LoraScale])
    names = admission.adapter_names(tenant)
    for lora_scale in lora_scales:
        if lora_scale.id >= len(names):
            raise GatewayError(404, f"adapter id {lora_scale.id} not found (this key has {len(names)} adapters)",
                           "adapter_not_found")
    scales = admission.enabled(tenant, {names[s.id]: s.scale for s in lora_scales})
    tenant.default_scales.clear()  # the tenant's own (this request's view of it shares the dict)
    tenant.default_scales.update(scales)
    return _lora_adapters(admission, catalog, tenant)
