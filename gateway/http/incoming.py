"""What every route does with a request before its own work (torch-free): find the app's gateway,
authenticate the caller (its request counts against its rate limit before its body is read),
read and validate the body, and tokenize or render prompts, large ones off the event loop; text
too long to fit the context is refused before tokenizing."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, TypeVar

from fastapi import Request

from gateway.catalog import Catalog
from gateway.compose import Gateway
from gateway.errors import GatewayError
from gateway.http.json_body import load_json, parse, read_body
from gateway.requests.admission import EXCEEDS_CONTEXT
from gateway.tenancy.tenants import Tenant
from gateway.tool_calls import ToolPlan, chat_input, rendered_size
from worker.formats.chat_template import ChatTemplateError, encode_chat
from worker.formats.tokenizer import TokenizerError

OFF_LOOP_CHARS = 4096  # texts longer than this are tokenized in a worker thread
T = TypeVar("T")


def credentials(request: Request) -> str | None:
    """The caller's key as an Authorization value: `Authorization: Bearer KEY`, or `X-Api-Key: KEY`
    (the Anthropic API's header, which llama-server accepts too)."""
    authorization = request.headers.get("authorization")
    if authorization is None and request.headers.get("x-api-key"):
        return f"Bearer {request.headers['x-api-key']}"
    return authorization


def gateway_of(request: Request) -> Gateway:
    """The gateway of the app serving `request` (create_app's `current`, or `app.state.gateway`)."""
    return request.app.state.find_gateway()


async def read_parsed(request: Request, body_type: Any) -> Any:
    """The JSON body, read to at most the configured size and validated against `body_type`."""
    return parse(body_type, load_json(await read_body(request, gateway_of(request).config.http.max_body_bytes)))


async def begin(request: Request, body_type: Any = None) -> tuple[Tenant, Any]:
    """The calling tenant (its request counted against its rate) and the parsed body (None without
    `body_type`): every route's first step, whose parts (tenants, limiter, registry) it finds itself."""
    gateway = gateway_of(request)
    gateway.registry.ensure_running()
    await gateway.tenants.refresh_if_stale()
    tenant = await gateway.tenants.authenticate_fresh(credentials(request))
    request.state.tenant_id = tenant.id  # the metrics' label of whatever this request is answered (gateway/http/observed.py)
    await gateway.limiter.admit(tenant)
    await gateway.registry.refresh_if_stale()
    body = None if body_type is None else await read_parsed(request, body_type)
    return tenant, body


async def off_loop(catalog: Catalog, num_chars: int, work: Callable[[], T]) -> T:
    """Tokenizing or rendering `num_chars` of text: refused when it cannot fit the context; off the
    event loop when large."""
    if num_chars > catalog.max_prompt_chars:
        raise GatewayError(400, f"the prompt ({num_chars} characters) cannot fit the model's context of "
                           f"{catalog.max_positions} tokens", "context_length_exceeded", kind=EXCEEDS_CONTEXT,
                           n_prompt_tokens=num_chars // catalog.longest_token_chars,  # at least that many
                           n_ctx=catalog.max_positions)
    try:
        return await asyncio.to_thread(work) if num_chars > OFF_LOOP_CHARS else work()
    except (TokenizerError, ChatTemplateError) as e:
        raise GatewayError(400, str(e), "invalid_prompt") from e


async def tokenized(catalog: Catalog, prompt: str | list[int]) -> list[int]:
    """A prompt's token ids (a list of ids is taken as it is)."""
    if isinstance(prompt, list):
        return prompt
    tokenizer = catalog.tokenizer  # raw prompts parse special tokens, as llama.cpp does
    return await off_loop(catalog, len(prompt), lambda: tokenizer.encode(prompt, add_special=True, parse_special=True))


def checked_chat_input(catalog: Catalog, body: Any) -> tuple[ToolPlan | None, list[dict[str, Any]], dict[str, Any]]:
    """A chat body's tool plan, messages and template arguments (a 400 for duplicate or unknown tools,
    or an earlier call's arguments that are not JSON)."""
    try:
        return chat_input(body, catalog.tool_style)
    except ValueError as e:
        raise GatewayError(400, str(e), "invalid_value") from e


async def chat_prompt(catalog: Catalog, body: Any) -> tuple[ToolPlan | None, list[int]]:
    """A chat body's tool plan and its prompt: its messages rendered with the model's template (a last
    assistant message as a prefill) and tokenized (the chat, Anthropic and Responses routes')."""
    tools, messages, extra = checked_chat_input(catalog, body)
    prompt_ids = await off_loop(catalog, rendered_size(messages, extra), lambda: encode_chat(catalog.tokenizer, messages, **extra))
    return tools, prompt_ids
