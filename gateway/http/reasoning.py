"""A chat request's reasoning at the HTTP edge (torch-free; the pure part is gateway/reasoning.py):
whether the template is asked to think, the plan its answer is split by, and the dispatcher that
keeps its thinking budget (gateway/requests/thinking_budget.py). The chat, Anthropic and Responses
routes all take this path, with the chat body their request amounts to (and /apply-template, for
the prompt alone).

Thinking off with a template that has no switch but opens the think block itself (DeepSeek-R1's):
the block is closed right after it in the prompt, so the answer begins after the thinking.

Structured output and grammar-enforced tools apply to the answer, not to the thinking: thinking is
left as the request, template and server ask, and the grammar is wrapped (reasoning.after_thinking)
so that the thinking is free text up to the end marker and the grammar binds what follows. Only a
model with no known thinking markers (parser `none`, or `auto` finding none) is rendered with
thinking off under a grammar: with no marker to end the thought, the grammar could not tell the
thinking from the answer. The thinking budget's second call continues under the answer's grammar
alone (`budgeted`).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from gateway.catalog import Catalog
from gateway.chat_templates import ChatRendering
from gateway.http.formatting import token_str
from gateway.http.incoming import chat_prompt, chat_text
from gateway.http.respond import Responder
from gateway.reasoning import (
    NO_REASONING,
    ReasoningPlan,
    ReasoningSplitter,
    after_thinking,
    opens_thinking,
    thinking_asked,
)
from gateway.requests.thinking_budget import BudgetedDispatcher
from gateway.tool_calls import GENERIC, ToolPlan

TAIL_TOKENS = 16  # of the prompt, read for a think block the template opened


def _is_constrained(catalog: Catalog, body: Any) -> bool:
    """A grammar will bind the answer: a response format or grammar, or tools it must call (every
    call, in the generic style)."""
    if hasattr(body, "grammar_source") and body.grammar_source() is not None:
        return True
    if not body.tools or body.tool_choice == "none":
        return False
    return catalog.tool_style == GENERIC or body.tool_choice not in (None, "auto")


def thinking_of(catalog: Catalog, body: Any) -> bool:
    """The template's `enable_thinking` for this chat body: what it asks, else the server's default;
    off when the thinking budget is 0, or a grammar binds the answer of a model with no known
    thinking markers (the grammar could not be put after the thinking)."""
    unwrappable = catalog.reasoning_tags is None and _is_constrained(catalog, body)
    if unwrappable or getattr(body, "thinking_budget", None) == 0:
        return False
    kwargs = getattr(body, "chat_template_kwargs", None) or {}
    asked = thinking_asked(kwargs.get("enable_thinking"), getattr(body, "reasoning_effort", None), catalog.default_thinking)
    return asked is not False


def _closes_thinking(catalog: Catalog, prompt_tail: str, thinking: bool | None) -> bool:
    """Thinking is off, yet the prompt opens a think block: it is to be closed."""
    tags = catalog.reasoning_tags
    return thinking is False and tags is not None and opens_thinking(prompt_tail, tags)


def _tail(catalog: Catalog, prompt_ids: list[int]) -> str:
    return "".join(token_str(catalog.tokenizer, t) for t in prompt_ids[-TAIL_TOKENS:])


def plan_of(catalog: Catalog, body: Any, starts_inside: bool, thinking: bool | None) -> ReasoningPlan:
    """The reasoning plan of a chat body whose prompt ends inside a think block when `starts_inside`."""
    tags = catalog.reasoning_tags
    if tags is None:
        return NO_REASONING
    budget = body.thinking_budget if thinking is not False else None
    return ReasoningPlan(tags, starts_inside, budget, is_split=body.reasoning_format != "none",
                         may_think=thinking is not False)


async def reasoning_prompt(catalog: Catalog, body: Any,
                           rendering: ChatRendering | None = None) -> tuple[ToolPlan | None, list[int], ReasoningPlan]:
    """A chat body's tool plan, its prompt (rendered with its thinking switch, and as `rendering` says:
    incoming.chat_prompt) and its reasoning plan."""
    thinking = thinking_of(catalog, body)
    tools, prompt_ids = await chat_prompt(catalog, body, thinking, rendering)
    tags = catalog.reasoning_tags
    starts_inside = tags is not None and opens_thinking(_tail(catalog, prompt_ids), tags)
    if starts_inside and thinking is False:  # closed here: the answer begins after the (empty) thinking
        prompt_ids = prompt_ids + catalog.tokenizer.encode(tags.end, add_special=False, parse_special=True)
        starts_inside = False
    return tools, prompt_ids, plan_of(catalog, body, starts_inside, thinking)


async def reasoning_text(catalog: Catalog, body: Any, rendering: ChatRendering | None = None) -> str:
    """A chat body's prompt as text (/apply-template), rendered as reasoning_prompt renders it."""
    thinking = thinking_of(catalog, body)
    text = await chat_text(catalog, body, rendering, thinking)
    return text + catalog.reasoning_tags.end if _closes_thinking(catalog, text[-200:], thinking) else text


def answer_grammar(catalog: Catalog, plan: ReasoningPlan, grammar: str | None) -> str | None:
    """The grammar the request's generation follows: `grammar` (the answer's) after the thinking when
    the model may think, else `grammar` itself (thinking off: the prompt closed the think block)."""
    tags = plan.tags
    if grammar is None or tags is None or not plan.may_think:
        return grammar
    end_ids = catalog.tokenizer.encode(tags.end, add_special=False, parse_special=True)
    is_special = len(end_ids) == 1 and end_ids[0] in catalog.tokenizer.special_ids
    return after_thinking(grammar, tags, plan.starts_inside, f"<[{end_ids[0]}]>" if is_special else None)


def budgeted(responder: Responder, catalog: Catalog, plan: ReasoningPlan, grammar: str | None = None) -> Responder:
    """`responder`, its dispatcher keeping the plan's thinking budget when it has one; `grammar`: the
    answer's own (unwrapped), which the call after the budget continues under."""
    tags = plan.tags
    if plan.budget_tokens is None or tags is None:
        return responder
    closing_text = f"\n{tags.end}\n\n"
    closing_ids = catalog.tokenizer.encode(closing_text, add_special=False, parse_special=True)
    dispatcher = BudgetedDispatcher(responder.dispatcher, plan.budget_tokens, closing_ids, closing_text,
                                    lambda: ReasoningSplitter(tags, plan.starts_inside), grammar)
    return replace(responder, dispatcher=dispatcher)
