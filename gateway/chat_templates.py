"""Which chat template a chat request renders with, and an aLoRA invoked from chat (torch-free, pure;
docs/adapters.md#chat-templates).

The template: the request's own `chat_template` where the operator allows it
(`http.allow_request_chat_template`), else the one the request's adapters carry
(`adapter.chat_template`), else the base model's. Stacked adapters whose templates differ are
a 400: no template is right for both.

An aLoRA turns on at its invocation tokens (worker/formats/alora.py). From chat it is asked for by
a last message whose role is one of its own (llama.cpp's aLoRA adapters use roles such as
`certainty`), not a chat role: the messages before it are rendered without a generation prompt
and the aLoRA's invocation tokens follow as the generation prompt, then that message's content,
if any, as text. The template never sees the role, so a template that knows only the chat roles
(or writes `None` for another) cannot spoil the invocation.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from gateway.catalog import AdapterInfo
from gateway.errors import GatewayError

CHAT_ROLES = frozenset({"system", "user", "assistant", "developer", "tool"})


@dataclass(frozen=True)
class ChatRendering:
    """How a chat request's messages become its prompt."""

    template: str | None = None  # None: the base model's
    template_kwargs: Mapping[str, Any] = field(default_factory=dict)  # more template variables (chat_template_kwargs)
    invocation_tokens: tuple[int, ...] | None = None  # the request's aLoRA's: a last message of a role of its own invokes it


def template_of(adapters: Sequence[AdapterInfo], requested: str | None, is_request_template_allowed: bool) -> str | None:
    """The template the request renders with (None: the base model's)."""
    if requested is not None:
        if not is_request_template_allowed:
            raise GatewayError(400, "chat_template: this server does not take a request's own chat template "
                               "(the operator's http.allow_request_chat_template is off)", "chat_template_not_allowed")
        return requested
    carried = {a.chat_template for a in adapters if a.chat_template is not None}
    if len(carried) > 1:
        names = ", ".join(sorted(a.name for a in adapters if a.chat_template is not None))
        raise GatewayError(400, f"the adapters {names} each carry a chat template of their own and they differ: "
                           "enable one of them in a request, or give chat_template", "chat_template_conflict")
    return next(iter(carried), None)


def rendering(adapters: Sequence[AdapterInfo], requested: str | None, template_kwargs: Mapping[str, Any] | None,
              is_request_template_allowed: bool) -> ChatRendering:
    """How a chat request renders with these adapters (the ones it enables)."""
    aloras = [a.invocation_tokens for a in adapters if a.invocation_tokens is not None]
    return ChatRendering(template_of(adapters, requested, is_request_template_allowed), dict(template_kwargs or {}),
                         aloras[0] if aloras else None)


def invocation_turn(messages: Sequence[Mapping[str, Any]],
                    invocation_tokens: tuple[int, ...] | None) -> tuple[list[Mapping[str, Any]], str | None]:
    """(the messages the template renders, the content of the aLoRA's invocation turn; None when the
    request has none). A 400 for a role of its own anywhere else, or with no aLoRA to invoke."""
    own = [i for i, m in enumerate(messages) if m.get("role") not in CHAT_ROLES]
    if not own:
        return list(messages), None
    i = own[0]
    role = messages[i].get("role")
    if invocation_tokens is None or own != [len(messages) - 1]:
        raise GatewayError(400, f"messages.{i}.role: {role!r} is not a chat role ({', '.join(sorted(CHAT_ROLES))}); a "
                           "role of its own invokes an aLoRA: only as the last message, of a request that enables "
                           "an aLoRA", "invalid_value")
    if i == 0:
        raise GatewayError(400, f"messages.0.role: an aLoRA's invocation ({role!r}) follows the conversation it "
                           "answers: give the messages before it", "invalid_value")
    content = messages[i].get("content")
    return list(messages[:i]), content if isinstance(content, str) else ""
