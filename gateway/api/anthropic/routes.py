"""The Anthropic Messages API (`/v1/messages`, `/v1/messages/count_tokens`; torch-free).

A body is translated to the chat request it means (gateway/api/anthropic/protocol.py) and run as
chat is, its tools by grammar; only the answer's shape is Anthropic's (anthropic_formats.py), and
so are its errors (gateway/api/app.py answers every error under /v1/messages in that shape).
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from gateway.api.anthropic.formats import MessageFormatter
from gateway.api.anthropic.protocol import CountTokensRequest, MessagesRequest
from gateway.http.incoming import begin, chat_rendering
from gateway.http.parts import AdmissionPart, CatalogPart, ResponderPart
from gateway.http.reasoning import answer_grammar, budgeted, reasoning_prompt
from gateway.http.respond import respond
from gateway.http.sampling import compiled_grammar, openai_params

router = APIRouter()


@router.post("/v1/messages")
async def messages(request: Request, catalog: CatalogPart, admission: AdmissionPart, responder: ResponderPart) -> Response:
    tenant, body = await begin(request, MessagesRequest)
    chat = body.as_chat()
    scales_by_name = admission.resolve_scales(tenant, chat.model, chat.lora)
    tools, prompt_ids, reasoning = await reasoning_prompt(catalog, chat, chat_rendering(admission, tenant, scales_by_name, chat))
    grammar = await compiled_grammar(catalog, chat, "output_config.format", tools)
    # Anthropic's clients ask for more than a small model's context holds: the answer ends where the context does
    room = catalog.max_positions - len(prompt_ids)
    is_clamped = chat.token_limit is not None and 0 < room < chat.token_limit
    max_tokens = room if is_clamped else chat.token_limit
    params = openai_params(admission, len(prompt_ids), max_tokens, chat, grammar=answer_grammar(catalog, reasoning, grammar))
    prepared = await admission.prepare(tenant, prompt_ids, params, scales_by_name, chat.cache_salt)
    formatter = MessageFormatter(body.model, len(prompt_ids), tools, is_clamped, reasoning)
    return await respond(budgeted(responder, catalog, reasoning, grammar), prepared, "messages", formatter, body.stream, done_marker=False)


@router.post("/v1/messages/count_tokens")
async def count_tokens(request: Request, catalog: CatalogPart, admission: AdmissionPart) -> dict[str, int]:
    tenant, body = await begin(request, CountTokensRequest)
    chat = body.as_chat()
    scales_by_name = admission.resolve_scales(tenant, chat.model, chat.lora)  # an unknown model is a 404 here too
    _, prompt_ids, _ = await reasoning_prompt(catalog, chat, chat_rendering(admission, tenant, scales_by_name, chat))
    return {"input_tokens": len(prompt_ids)}
