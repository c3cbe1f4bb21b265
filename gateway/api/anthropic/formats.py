"""Response bodies of the Anthropic Messages API, built from the worker's `Delta`s (torch-free): the
whole `message`, or its stream of named events (message_start, content_block_start/delta/stop,
ping, message_delta, message_stop). With tools, the text is read for calls as chat's is
(gateway/tool_calls.py) and each call is a `tool_use` block with its `input` as an object. With a
reasoning plan that splits, the thinking is a `thinking` block first (streamed as thinking_delta
events, then a signature_delta: our signature is an opaque digest of the thinking, which nothing
checks), and only the answer after it is text and read for calls.

Usage splits the prompt as Anthropic does: `input_tokens` are the prompt tokens computed anew,
`cache_read_input_tokens` those whose KV came from our prefix cache (nothing is ever billed as
written to a cache). A stream's message_start knows only the prompt's size; its message_delta
carries the final split.
"""

from __future__ import annotations

import hashlib
import json
import uuid
from typing import Any

from gateway.errors import GatewayError
from gateway.http.formatting import total_usage
from gateway.reasoning import NO_REASONING, ReasoningCounter, ReasoningPlan
from gateway.tool_calls import ToolCall, ToolPlan
from worker.contract.calls import Delta

JSONObject = dict[str, Any]


def usage_of(final: Delta) -> JSONObject:
    u = total_usage([final])
    return {"input_tokens": u.prompt_tokens - u.cached_tokens, "output_tokens": u.completion_tokens,
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": u.cached_tokens}


def stop_of(final: Delta, called: bool, is_clamped: bool = False) -> JSONObject:
    """Why the answer ended, in Anthropic's words, and the stop sequence that ended it (`is_clamped`:
    its max_tokens did not fit the context, so its length was the context's)."""
    if final.finish_reason == "length":
        reason = "model_context_window_exceeded" if is_clamped else "max_tokens"
    elif final.stop_word is not None:
        reason = "stop_sequence"
    else:
        reason = "tool_use" if called else "end_turn"
    return {"stop_reason": reason, "stop_sequence": final.stop_word}


def tool_use_id(call_id: str) -> str:
    return "toolu_" + call_id.removeprefix("call_")


def signature_of(thinking: str) -> str:
    """A thinking block's signature: opaque to clients, the same for the same thinking."""
    return hashlib.sha256(thinking.encode()).hexdigest()[:32]


def thinking_block(thinking: str) -> JSONObject:
    return {"type": "thinking", "thinking": thinking, "signature": signature_of(thinking)}


def tool_use_block(call: ToolCall) -> JSONObject:
    return {"type": "tool_use", "id": tool_use_id(call.id), "name": call.name, "input": json.loads(call.arguments)}


ANTHROPIC_TYPES: dict[int, str] = {
    400: "invalid_request_error", 401: "authentication_error", 403: "permission_error", 404: "not_found_error",
    413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error", 504: "timeout_error",
}


def anthropic_error(error: GatewayError) -> JSONObject:
    """`error` in the Anthropic API's error shape (its `error` event's data too)."""
    kind = ANTHROPIC_TYPES.get(error.status, "invalid_request_error" if error.status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": error.message}}


class MessageFormatter:
    """One answer (Anthropic has no `n`) as a `message`, or as the events of its stream."""

    named_events = True  # each event is framed `event: <its type>`

    def __init__(self, model: str, num_prompt_tokens: int, tools: ToolPlan | None = None, is_clamped: bool = False,
                 reasoning: ReasoningPlan = NO_REASONING) -> None:
        self.model, self.num_prompt_tokens, self.tools, self.is_clamped = model, num_prompt_tokens, tools, is_clamped
        self.reasoning = reasoning
        self.id = f"msg_{uuid.uuid4().hex[:24]}"
        self._reader = tools.reader() if tools is not None else None  # streaming with tools
        self._counter = ReasoningCounter(reasoning)  # streaming: the thinking split off
        self._num_blocks = 0  # content blocks started so far
        self._open: str | None = None  # the type of the last block, when it still takes deltas (text, thinking)
        self._thought: list[str] = []  # the streamed thinking so far (its signature is over the whole)

    def error_event(self, error: GatewayError) -> JSONObject:
        return anthropic_error(error)

    def _head(self) -> JSONObject:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model}

    def whole(self, deltas: list[Delta]) -> JSONObject:
        counter = ReasoningCounter(self.reasoning)
        pieces = [counter.feed(d.text, len(d.token_ids), d.finish_reason is not None) for d in deltas]
        text = "".join(said for _, said in pieces)
        thinking = [thinking_block("".join(t for t, _ in pieces))] if counter.has_reasoning else []
        calls: list[ToolCall] = []
        if self.tools is None:
            content = [*thinking, {"type": "text", "text": text}]
        else:
            said, calls = self.tools.parse(text)
            content = thinking + ([{"type": "text", "text": said}] if said else []) + [tool_use_block(c) for c in calls]
        final = deltas[-1]
        return {**self._head(), "content": content, **stop_of(final, bool(calls), self.is_clamped), "usage": usage_of(final)}

    def chunk(self, delta: Delta, first: bool) -> list[JSONObject]:
        events: list[JSONObject] = []
        if first:
            usage = {"input_tokens": self.num_prompt_tokens, "output_tokens": 0, "cache_creation_input_tokens": 0,
                     "cache_read_input_tokens": 0}
            message = {**self._head(), "content": [], "stop_reason": None, "stop_sequence": None, "usage": usage}
            events.append({"type": "message_start", "message": message})
            if self._reader is None and self.reasoning.splitter() is None:  # plain text: one block, open from the start
                events += self._start({"type": "text", "text": ""})
            events.append({"type": "ping"})
        thought, text = self._counter.feed(delta.text, len(delta.token_ids), delta.finish_reason is not None)
        events += self._thinking(thought)
        if self._reader is None:
            pieces: list[str | JSONObject] = [text]
        else:
            pieces = self._reader.feed(text) + (self._reader.finish() if delta.finish_reason is not None else [])
        for piece in pieces:
            events += self._text(piece) if isinstance(piece, str) else self._tool_use(piece)
        if delta.finish_reason is not None:
            if self._num_blocks == 0 and self._reader is None:  # nothing said: one empty text block, as whole has
                events += self._start({"type": "text", "text": ""})
            events += self._stop()
            called = self._reader is not None and self._reader.num_calls > 0
            events.append({"type": "message_delta", "delta": stop_of(delta, called, self.is_clamped), "usage": usage_of(delta)})
            events.append({"type": "message_stop"})
        return events

    def _start(self, block: JSONObject) -> list[JSONObject]:
        self._num_blocks += 1
        self._open = block["type"] if block["type"] in ("text", "thinking") else None
        return [{"type": "content_block_start", "index": self._num_blocks - 1, "content_block": block}]

    def _stop(self) -> list[JSONObject]:
        """The open text or thinking block's end (a thinking block's signature first), if one is open."""
        if self._open is None:
            return []
        index, events = self._num_blocks - 1, []
        if self._open == "thinking":
            delta = {"type": "signature_delta", "signature": signature_of("".join(self._thought))}
            events.append({"type": "content_block_delta", "index": index, "delta": delta})
        self._open = None
        return events + [{"type": "content_block_stop", "index": index}]

    def _text(self, text: str) -> list[JSONObject]:
        if not text:
            return []
        events = [] if self._open == "text" else self._stop() + self._start({"type": "text", "text": ""})
        delta = {"type": "text_delta", "text": text}
        return events + [{"type": "content_block_delta", "index": self._num_blocks - 1, "delta": delta}]

    def _thinking(self, thought: str) -> list[JSONObject]:
        if not thought:
            return []
        events = [] if self._open == "thinking" else self._start({"type": "thinking", "thinking": "", "signature": ""})
        self._thought.append(thought)
        delta = {"type": "thinking_delta", "thinking": thought}
        return events + [{"type": "content_block_delta", "index": self._num_blocks - 1, "delta": delta}]

    def _tool_use(self, call: JSONObject) -> list[JSONObject]:
        """A complete call (a streamed OpenAI tool-call entry) as a block of its own."""
        function = call["function"]
        events = self._stop() + self._start({"type": "tool_use", "id": tool_use_id(call["id"]), "name": function["name"],
                                             "input": {}})
        index = self._num_blocks - 1
        delta = {"type": "input_json_delta", "partial_json": function["arguments"]}
        return events + [{"type": "content_block_delta", "index": index, "delta": delta},
                         {"type": "content_block_stop", "index": index}]
