"""OpenAI's API (SPEC §6; torch-free): `/v1/completions`, `/v1/chat/completions` and `/v1/models`.
A tenant's adapters are models of their own, whose parent is the base model."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from gateway.api.formats import ChatFormatter, CompletionFormatter
from gateway.api.incoming import begin, checked_chat_input, off_loop, tokenized
from gateway.api.protocol import ChatRequest, CompletionRequest
from gateway.api.respond import UsageChunk, respond
from gateway.api.sampling import compiled_grammar, openai_params
from gateway.api.tools import rendered_size
from worker.formats.chat_template import encode_chat

router = APIRouter()


def _usage_chunk(body: CompletionRequest | ChatRequest,
                 formatter: CompletionFormatter | ChatFormatter) -> UsageChunk | None:
    """The usage event a streamed answer ends with, when `stream_options.include_usage` asks for it."""
    return formatter.usage_chunk if body.stream_options and body.stream_options.include_usage else None


@router.post("/v1/completions")
async def completions(request: Request) -> Response:
    gateway, tenant, body = await begin(request, CompletionRequest)
    scales_by_name = gateway.admission.resolve_scales(tenant, body.model, body.lora)
    prompt_ids = await tokenized(gateway, body.prompt)
    grammar = await compiled_grammar(gateway, body, "response_format")
    is_ranked = body.num_samples > body.n  # best_of: every sample's token log-probabilities rank them
    logprobs = body.logprobs if body.logprobs is not None or not is_ranked else 0
    echo = body.echo and body.logprobs is not None  # the worker computes the prompt's log-probabilities only when asked
    params = openai_params(gateway, len(prompt_ids), body.max_tokens, body, logprobs, echo, grammar, body.num_samples)
    prepared = await gateway.admission.prepare(tenant, prompt_ids, params, scales_by_name, body.cache_salt,
                                               timeout_s=body.timeout_s)
    formatter = CompletionFormatter(gateway.catalog.tokenizer, body.model or gateway.catalog.model_name, prompt_ids,
                                    body.echo, body.logprobs, keep=body.n if is_ranked else None)
    return await respond(gateway, prepared, "completions", formatter, body.stream, _usage_chunk(body, formatter))


@router.post("/v1/chat/completions")
async def chat(request: Request) -> Response:
    gateway, tenant, body = await begin(request, ChatRequest)
    scales_by_name = gateway.admission.resolve_scales(tenant, body.model, body.lora)
    tools, messages, extra = checked_chat_input(gateway, body)
    prompt_ids = await off_loop(gateway, rendered_size(messages, extra),
                                lambda: encode_chat(gateway.catalog.tokenizer, messages, **extra))
    num_top_logprobs = (body.top_logprobs or 0) if body.logprobs else None
    grammar = await compiled_grammar(gateway, body, "response_format", tools)
    params = openai_params(gateway, len(prompt_ids), body.token_limit, body, num_top_logprobs, grammar=grammar,
                           n=body.n)
    prepared = await gateway.admission.prepare(tenant, prompt_ids, params, scales_by_name, body.cache_salt,
                                               timeout_s=body.timeout_s)
    formatter = ChatFormatter(gateway.catalog.tokenizer, body.model or gateway.catalog.model_name, num_top_logprobs,
                              tools)
    return await respond(gateway, prepared, "chat", formatter, body.stream, _usage_chunk(body, formatter))


@router.get("/v1/models")
async def models(request: Request) -> dict[str, Any]:
    gateway, tenant, _ = await begin(request)
    base = gateway.catalog.model_name
    data = [{"id": base, "object": "model", "created": 0, "owned_by": "loraplex"}]
    data += [{"id": name, "object": "model", "created": 0, "owned_by": "loraplex", "parent": base}
             for name in gateway.admission.adapter_names(tenant)]
    return {"object": "list", "data": data}
