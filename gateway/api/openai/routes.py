"""OpenAI's API (docs/api.md#openai; torch-free): `/v1/completions`, `/v1/chat/completions` and `/v1/models`
(and llama-server's names for the last two, `/chat/completions` and `/models`, and its chat
prompt count, `/v1/chat/completions/input_tokens`). A tenant's adapters are models of their own,
whose parent is the base model."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from gateway.api.openai.formats import ChatFormatter, CompletionFormatter
from gateway.api.openai.protocol import ChatRequest, CompletionRequest
from gateway.http.formatting import PromptProgress, TokenTimings
from gateway.http.incoming import begin, chat_rendering, tokenized
from gateway.http.parts import AdmissionPart, CatalogPart, ResponderPart
from gateway.http.reasoning import answer_grammar, budgeted, reasoning_prompt
from gateway.http.respond import UsageChunk, respond
from gateway.http.sampling import compiled_grammar, openai_params

router = APIRouter()


def _usage_chunk(body: CompletionRequest | ChatRequest,
                 formatter: CompletionFormatter | ChatFormatter) -> UsageChunk | None:
    """The usage event a streamed answer ends with, when `stream_options.include_usage` asks for it."""
    return formatter.usage_chunk if body.stream_options and body.stream_options.include_usage else None


@router.post("/v1/completions")
async def completions(request: Request, catalog: CatalogPart, admission: AdmissionPart, responder: ResponderPart) -> Response:
    tenant, body = await begin(request, CompletionRequest)
    scales_by_name = admission.resolve_scales(tenant, body.model, body.lora)
    prompt_ids = await tokenized(catalog, body.prompt)
    grammar = await compiled_grammar(catalog, body, body.grammar_field)
    is_ranked = body.num_samples > body.n  # best_of: every sample's token log-probabilities rank them
    logprobs = body.logprobs if body.logprobs is not None or not is_ranked else 0
    echo = body.echo and body.logprobs is not None  # the worker computes the prompt's log-probabilities only when asked
    params = openai_params(admission, len(prompt_ids), body.max_tokens, body, logprobs, echo, grammar, body.num_samples)
    prepared = await admission.prepare(tenant, prompt_ids, params, scales_by_name, body.cache_salt,
                                               timeout_s=body.timeout_s)
    formatter = CompletionFormatter(catalog.tokenizer, body.model or catalog.model_name, prompt_ids,
                                    body.echo, body.logprobs, keep=body.n if is_ranked else None)
    return await respond(responder, prepared, "completions", formatter, body.stream, _usage_chunk(body, formatter))


@router.post("/v1/chat/completions")
@router.post("/chat/completions")  # llama-server's alias
async def chat(request: Request, catalog: CatalogPart, admission: AdmissionPart, responder: ResponderPart) -> Response:
    tenant, body = await begin(request, ChatRequest)
    scales_by_name = admission.resolve_scales(tenant, body.model, body.lora)
    tools, prompt_ids, reasoning = await reasoning_prompt(catalog, body, chat_rendering(admission, tenant, scales_by_name, body))
    num_top_logprobs = (body.top_logprobs or 0) if body.logprobs else None
    grammar = await compiled_grammar(catalog, body, body.grammar_field, tools)
    params = openai_params(admission, len(prompt_ids), body.token_limit, body, num_top_logprobs,
                           grammar=answer_grammar(catalog, reasoning, grammar), n=body.n)
    prepared = await admission.prepare(tenant, prompt_ids, params, scales_by_name, body.cache_salt,
                                               timeout_s=body.timeout_s)
    progress = PromptProgress(len(prompt_ids)) if body.return_progress and body.stream else None
    timings = TokenTimings(len(prompt_ids)) if body.timings_per_token and body.stream else None
    formatter = ChatFormatter(catalog.tokenizer, body.model or catalog.model_name, num_top_logprobs,
                              tools, progress, reasoning, timings)
    return await respond(budgeted(responder, catalog, reasoning, grammar), prepared, "chat", formatter, body.stream,
                         _usage_chunk(body, formatter))


@router.post("/v1/chat/completions/input_tokens")
@router.post("/chat/completions/input_tokens")
async def chat_input_tokens(request: Request, catalog: CatalogPart, admission: AdmissionPart) -> dict[str, Any]:
    """llama-server's count of the tokens a chat body's prompt takes, generating nothing."""
    tenant, body = await begin(request, ChatRequest)
    scales_by_name = admission.resolve_scales(tenant, body.model, body.lora)  # an unknown model is a 404 here too
    _, prompt_ids, _ = await reasoning_prompt(catalog, body, chat_rendering(admission, tenant, scales_by_name, body))
    return {"object": "response.input_tokens", "input_tokens": len(prompt_ids)}


@router.get("/v1/models")
@router.get("/models")  # llama-server's alias
async def models(request: Request, catalog: CatalogPart, admission: AdmissionPart) -> dict[str, Any]:
    """The base model and the tenant's adapters: OpenAI's `data`, and llama-server's `models` list
    (Ollama's shape), which says what we know (no sizes or digests)."""
    tenant, _ = await begin(request)
    base = catalog.model_name
    parents = {base: None} | {name: base for name in admission.adapter_names(tenant)}
    data = [{"id": name, "object": "model", "created": 0, "owned_by": "loraplex", **({"parent": p} if p else {})}
            for name, p in parents.items()]
    listed = [{"name": name, "model": name, "modified_at": "", "size": "", "digest": "", "type": "model",
               "description": "", "tags": [""], "capabilities": ["completion"], "parameters": "",
               "details": {"parent_model": p or "", "format": "gguf", "family": "", "families": [""],
                           "parameter_size": "", "quantization_level": ""}}
              for name, p in parents.items()]
    return {"object": "list", "data": data, "models": listed}
