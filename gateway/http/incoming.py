"""What every route does with a request before its own work (torch-free): find the app's gateway,
authenticate the caller (its request counts against its rate limit before its body is read),
read and validate the body, and tokenize or render prompts, large ones off the event loop; text
too long to fit the context is refused before tokenizing."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from fastapi import Request

from gateway.catalog import Catalog
from gateway.chat_templates import ChatRendering, invocation_turn, rendering
from gateway.compose import Gateway
from gateway.errors import GatewayError
from gateway.http.json_body import load_json, parse, read_body
from gateway.requests.admission import EXCEEDS_CONTEXT, Admission
from gateway.tenancy.tenants import Tenant
from gateway.tool_calls import ToolPlan, chat_input, rendered_size
from worker.formats.chat_template import ChatTemplateError, encode_chat, render_chat
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


async def off_loop(catalog: Catalog, num_chars: int, work: Callable[[], T], always_off_loop: bool = False) -> T:
    """Tokenizing or rendering `num_chars` of text: refused when it cannot fit the context; off the
    event loop when large (or `always_off_loop`)."""
    if num_chars > catalog.max_prompt_chars:
        raise GatewayError(400, f"the prompt ({num_chars} characters) cannot fit the model's context of "
                           f"{catalog.max_positions} tokens", "context_length_exceeded", kind=EXCEEDS_CONTEXT,
                           n_prompt_tokens=num_chars // catalog.longest_token_chars,  # at least that many
                           n_ctx=catalog.max_positions)
    try:
        return await asyncio.to_thread(work) if num_chars > OFF_LOOP_CHARS or always_off_loop else work()
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


def chat_rendering(admission: Admission, tenant: Tenant, scales_by_name: Mapping[str, float], body: Any) -> ChatRendering:
    """How a chat body renders with the adapters it enables (`scales_by_name`, resolve_scales'): its own
    template where allowed, else theirs, else the model's; its template variables; its aLoRA."""
    infos = admission.adapters(tenant)
    return rendering([infos[name] for name in scales_by_name if name in infos], getattr(body, "chat_template", None),
                     getattr(body, "chat_template_kwargs", None), admission.config.http.allow_request_chat_template)


def _chat_parts(catalog: Catalog, body: Any, thinking: bool | None,
                rendering: ChatRendering) -> tuple[ToolPlan | None, list[dict[str, Any]], dict[str, Any], str | None]:
    """A chat body's tool plan, the messages its template renders, the template's other arguments, and
    the content of an aLoRA's invocation turn (None: it has none)."""
    tools, messages, extra = checked_chat_input(catalog, body)
    if thinking is not None:
        extra["enable_thinking"] = thinking
    rendered, invoked = invocation_turn(messages, rendering.invocation_tokens)
    if invoked is not None:  # the invocation tokens are the generation prompt
        extra.pop("continue_final", None)
        extra["add_generation_prompt"] = False
    return tools, rendered, extra, invoked


async def _rendered(catalog: Catalog, rendering: ChatRendering, num_chars: int, work: Callable[[], T]) -> T:
    """`work` (a render) off the event loop when large, or always when the template is not the base's
    (a tenant's code, which may take up to its time limit)."""
    return await off_loop(catalog, num_chars, work, always_off_loop=rendering.template is not None)


async def chat_prompt(catalog: Catalog, body: Any, thinking: bool | None = None,
                      rendering: ChatRendering | None = None) -> tuple[ToolPlan | None, list[int]]:
    """A chat body's tool plan and its prompt: its messages rendered (a last assistant message as a
    prefill) and tokenized (the chat, Anthropic and Responses routes'). `rendering` (gateway/chat_templates.py):
    the template (the request's adapters' or its own; None: the model's), its variables
    (`chat_template_kwargs`) and an aLoRA invocation's tokens, appended after the conversation.
    `thinking`, when not None, is the template's `enable_thinking` (gateway/http/reasoning.py)."""
    rendering = rendering or ChatRendering()
    tools, messages, extra, invoked = _chat_parts(catalog, body, thinking, rendering)
    tokenizer = catalog.tokenizer

    def work() -> list[int]:
        ids = encode_chat(tokenizer, messages, template=rendering.template, template_kwargs=rendering.template_kwargs,
                          max_chars=catalog.max_prompt_chars, **extra)
        if invoked is None or rendering.invocation_tokens is None:
            return ids
        return ids + list(rendering.invocation_tokens) + tokenizer.encode(invoked, add_special=False, parse_special=False)

    num_chars = rendered_size(messages, extra) + len(invoked or "")
    return tools, await _rendered(catalog, rendering, num_chars, work)


async def chat_text(catalog: Catalog, body: Any, rendering: ChatRendering | None = None,
                    thinking: bool | None = None) -> str:
    """A chat body's prompt as text (llama-server's /apply-template): as chat_prompt renders it, an aLoRA
    invocation's tokens as their text."""
    rendering = rendering or ChatRendering()
    _, messages, extra, invoked = _chat_parts(catalog, body, thinking, rendering)
    tokenizer = catalog.tokenizer

    def work() -> str:
        text = render_chat(tokenizer, messages, template=rendering.template, template_kwargs=rendering.template_kwargs,
                           max_chars=catalog.max_prompt_chars, **extra)
        if invoked is None or rendering.invocation_tokens is None:
            return text
        return text + tokenizer.decode(list(rendering.invocation_tokens), skip_special=False) + invoked

    return await _rendered(catalog, rendering, rendered_size(messages, extra) + len(invoked or ""), work)
