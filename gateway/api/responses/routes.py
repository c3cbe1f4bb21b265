"""The OpenAI Responses API (torch-free): `POST /v1/responses` (and `/responses`, as llama-server), and a stored response's
`GET`, `DELETE` and `GET .../input_items`.

A request becomes a chat body (gateway/api/responses/protocol.py) and takes chat's path: tools
and text.format enforced by grammar, the chat template, admission, `respond`. Its answer is a
`response` object or its typed events (gateway/api/responses/formats.py). With `store` (the
default) the response and the conversation that led to it are kept per tenant
(gateway/requests/response_store.py) before the client is told it is done; a store that fails then is
logged and the answer still goes out (the generation is done; that id is unknown later). A
request that needs a stored response (`previous_response_id`) while the store is unreachable is
a 503.
"""

from __future__ import annotations

import functools
import logging
import re
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse

from gateway.api.openai.protocol import MAX_MESSAGES, ChatRequest
from gateway.api.responses.formats import ResponsesFormatter
from gateway.api.responses.protocol import ResponsesRequest
from gateway.errors import GatewayError
from gateway.http.formatting import PromptProgress, TokenTimings
from gateway.http.incoming import begin, chat_rendering
from gateway.http.json_body import parse
from gateway.http.parts import AdmissionPart, CatalogPart, ResponderPart, ResponsesPart
from gateway.http.reasoning import answer_grammar, budgeted, reasoning_prompt
from gateway.http.respond import respond
from gateway.http.sampling import compiled_grammar, openai_params
from gateway.requests.response_store import RecordTooLarge, ResponseStore, StoredResponse, StoreUnavailable
from gateway.tenancy.tenants import Tenant

log = logging.getLogger(__name__)
router = APIRouter()
RESPONSE_ID = re.compile(r"^resp_[0-9a-f]{32}$")  # what new_id("resp") makes; anything else is unknown
MAX_LISTED_ITEMS = 100  # input_items' `limit`, as OpenAI bounds it
STORE_RETRY_AFTER_S = 1


def _unavailable() -> GatewayError:
    return GatewayError(503, "stored responses are unavailable: retry later", "store_unavailable",
                    {"Retry-After": str(STORE_RETRY_AFTER_S)})


async def _stored(responses: ResponseStore, tenant: Tenant, response_id: str) -> StoredResponse:
    """The tenant's stored response; 404 when unknown, expired, deleted or another tenant's (all
    alike), 503 when the store cannot be read."""
    try:
        record = await responses.get(tenant.id, response_id) if RESPONSE_ID.match(response_id) else None
    except StoreUnavailable as e:
        raise _unavailable() from e
    if record is None:
        raise GatewayError(404, f"Response with id {response_id!r} not found.", "response_not_found")
    return record


async def _keep(responses: ResponseStore, tenant: Tenant, formatter: ResponsesFormatter, input_items: list[dict[str, Any]]) -> None:
    """Store the finished response; a failure is logged, never the client's error."""
    try:
        await responses.put(tenant.id, StoredResponse(formatter.final, input_items))
    except (StoreUnavailable, RecordTooLarge) as e:
        log.warning("response %s of tenant %s was answered but not stored: %s", formatter.id, tenant.id, e)


async def _kept_before_the_end(events: AsyncIterator[bytes], formatter: ResponsesFormatter,
                               keep: Callable[[], Awaitable[None]]) -> AsyncIterator[bytes]:
    """A stream's events, the response stored as soon as it is final: before the event that says so
    is sent (the formatter makes the last delta's events at once, before the first is framed)."""
    is_kept = False
    async with aclosing(events):  # a client that went away closes the answer's events at once
        async for event in events:
            if formatter.final is not None and not is_kept:
                is_kept = True
                await keep()
            yield event


@router.post("/v1/responses")
@router.post("/responses")  # llama-server's other path for it: the same body and answer
async def create(request: Request, catalog: CatalogPart, admission: AdmissionPart, responses: ResponsesPart,
                 responder: ResponderPart) -> Response:
    tenant, body = await begin(request, ResponsesRequest)
    scales_by_name = admission.resolve_scales(tenant, body.model, body.lora)
    earlier = None if body.previous_response_id is None else await _stored(responses, tenant, body.previous_response_id)
    input_items = (earlier.conversation() if earlier is not None else []) + body.input_items()
    if not input_items and not body.instructions:
        raise GatewayError(400, "input: nothing to answer (give an item, instructions or previous_response_id)",
                       "invalid_value")
    if len(input_items) >= MAX_MESSAGES:
        raise GatewayError(400, f"the conversation holds {len(input_items)} items (previous_response_id's included), "
                       f"more than the {MAX_MESSAGES - 1} a request may have", "invalid_value")
    chat_body = parse(ChatRequest, body.chat_body(input_items))
    tools, prompt_ids, reasoning = await reasoning_prompt(catalog, chat_body,
                                                          chat_rendering(admission, tenant, scales_by_name, chat_body))
    grammar = await compiled_grammar(catalog, chat_body, "text.format", tools)
    params = openai_params(admission, len(prompt_ids), body.max_output_tokens, chat_body,
                           grammar=answer_grammar(catalog, reasoning, grammar))
    prepared = await admission.prepare(tenant, prompt_ids, params, scales_by_name, body.cache_salt,
                                               timeout_s=body.timeout_s)
    streamed = body.stream
    formatter = ResponsesFormatter(body.model or catalog.model_name, body.echoed(), tools, reasoning=reasoning,
                                   progress=PromptProgress(len(prompt_ids)) if body.return_progress and streamed else None,
                                   timings=TokenTimings(len(prompt_ids)) if body.timings_per_token and streamed else None)
    answer = await respond(budgeted(responder, catalog, reasoning, grammar), prepared, "responses", formatter, body.stream,
                           done_marker=False)
    if body.store:
        keep = functools.partial(_keep, responses, tenant, formatter, input_items)
        if isinstance(answer, StreamingResponse):
            answer.body_iterator = _kept_before_the_end(answer.body_iterator, formatter, keep)
        else:
            await keep()
    return answer


@router.get("/v1/responses/{response_id}")
async def retrieve(request: Request, response_id: str, responses: ResponsesPart) -> dict[str, Any]:
    tenant, _ = await begin(request)
    return (await _stored(responses, tenant, response_id)).response


@router.delete("/v1/responses/{response_id}")
async def delete(request: Request, response_id: str, responses: ResponsesPart) -> dict[str, Any]:
    tenant, _ = await begin(request)
    try:
        is_deleted = RESPONSE_ID.match(response_id) is not None and await responses.delete(tenant.id, response_id)
    except StoreUnavailable as e:
        raise _unavailable() from e
    if not is_deleted:
        raise GatewayError(404, f"Response with id {response_id!r} not found.", "response_not_found")
    return {"id": response_id, "object": "response.deleted", "deleted": True}


@router.get("/v1/responses/{response_id}/input_items")
async def input_items(request: Request, response_id: str, responses: ResponsesPart) -> dict[str, Any]:
    """A page of the items that led to a response (query: `order`, newest first by default as
    OpenAI's; `after`, an item's id; `limit`)."""
    tenant, _ = await begin(request)
    query = request.query_params
    order, after, limit = query.get("order", "desc"), query.get("after"), query.get("limit", "20")
    if order not in ("asc", "desc") or not (limit.isascii() and limit.isdigit()) or not 1 <= int(limit) <= MAX_LISTED_ITEMS:
        raise GatewayError(400, f"order must be asc or desc, and limit between 1 and {MAX_LISTED_ITEMS}", "invalid_value")
    items = (await _stored(responses, tenant, response_id)).input_items
    items = items if order == "asc" else items[::-1]
    ids = [item["id"] for item in items]
    if after is not None:
        if after not in ids:
            raise GatewayError(400, f"after: no item {after!r} in this response's input", "invalid_value")
        items = items[ids.index(after) + 1 :]
    page = items[: int(limit)]
    return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None, "has_more": len(items) > len(page)}
