"""The Responses API's answer (torch-free): a `response` object whole, or its typed stream events,
built from the worker's `Delta`s.

One state machine makes both: `chunk` turns each delta into events (`response.created` and
`response.in_progress` first; an output item's `added`, its deltas, its `done`; then
`response.completed`, or `response.incomplete` when max_output_tokens cut it), and `whole` runs
the deltas through it and keeps the last response, so a streamed answer and a whole one have the
same items. With tools, the text is read for calls as chat's is (gateway/tool_calls.py): the pieces
between calls are one message item each, every call a `function_call` item. With a reasoning plan
that splits, the thinking is a `reasoning` item first, its text a `reasoning_text` content part
(streamed as response.reasoning_text.delta events), and only the answer after it is read.

llama-server's additions, asked for by name: `progress` (`return_progress`) puts
`response.in_progress` events with a `prompt_progress` after the first two; `timings`
(`timings_per_token`) puts the timings so far on each text delta's event, and the whole
request's on the last event, beside its response.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from gateway.api.responses.protocol import new_id
from gateway.errors import GatewayError
from gateway.http.formatting import PromptProgress, TokenTimings, llama_timings
from gateway.reasoning import NO_REASONING, ReasoningCounter, ReasoningPlan
from gateway.tool_calls import ToolPlan, ToolReader
from worker.contract.calls import Delta

JSONObject = dict[str, Any]
INCOMPLETE_REASONS = {"length": "max_output_tokens"}  # a delta's finish_reason -> incomplete_details.reason


def usage_of(final: Delta, num_reasoning_tokens: int = 0) -> JSONObject | None:
    u = final.usage
    if u is None:
        return None
    return {"input_tokens": u.prompt_tokens, "input_tokens_details": {"cached_tokens": u.cached_tokens},
            "output_tokens": u.completion_tokens, "output_tokens_details": {"reasoning_tokens": num_reasoning_tokens},
            "total_tokens": u.prompt_tokens + u.completion_tokens}


def _text_part(text: str) -> JSONObject:
    return {"type": "output_text", "text": text, "annotations": []}


def _reasoning_part(text: str) -> JSONObject:
    return {"type": "reasoning_text", "text": text}


class ResponsesFormatter:
    """One response's object and events. `echoed`: the request's parameters the response carries
    (ResponsesRequest.echoed). Once the last delta is formatted, `final` is the whole response."""

    named_events = True  # each event is framed `event: <its type>`

    def __init__(self, model: str, echoed: JSONObject, tools: ToolPlan | None,
                 clock: Callable[[], float] = time.time, reasoning: ReasoningPlan = NO_REASONING,
                 progress: PromptProgress | None = None, timings: TokenTimings | None = None) -> None:
        self.model, self.echoed, self.tools = model, echoed, tools
        self.progress, self.timings = progress, timings
        self._delta_timings: JSONObject = {}  # with `timings`: the current delta's, for its text events
        self._counter = ReasoningCounter(reasoning)  # the thinking split off the answer
        self._reasoning: JSONObject | None = None  # the reasoning item receiving text, if one is open
        self._thought: list[str] = []  # its text so far
        self.id, self.created_at = new_id("resp"), int(clock())
        self.final: JSONObject | None = None
        self._num_events = 0
        self._items: list[JSONObject] = []  # output items, done or in progress
        self._message: JSONObject | None = None  # the message item receiving text, if one is open
        self._pieces: list[str] = []  # its text so far (joined once, when it closes)
        self._reader: ToolReader | None = tools.reader() if tools is not None else None

    def response(self, status: str, final: Delta | None = None) -> JSONObject:
        reason = INCOMPLETE_REASONS.get(final.finish_reason or "") if final is not None else None
        return {
            "id": self.id, "object": "response", "created_at": self.created_at, "status": status, "error": None,
            "incomplete_details": {"reason": reason} if status == "incomplete" else None, "model": self.model,
            "output": [dict(item) for item in self._items],
            "usage": usage_of(final, self._counter.num_reasoning_tokens) if final is not None else None,
            **self.echoed,
        }

    def _event(self, kind: str, **fields: Any) -> JSONObject:
        self._num_events += 1
        return {"type": kind, "sequence_number": self._num_events - 1, **fields}

    # output items

    def _open_message(self) -> list[JSONObject]:
        self._message = {"type": "message", "id": new_id("msg"), "status": "in_progress", "role": "assistant",
                         "content": []}
        self._pieces = []
        self._items.append(self._message)
        where = {"item_id": self._message["id"], "output_index": len(self._items) - 1, "content_index": 0}
        return [self._event("response.output_item.added", output_index=where["output_index"],
                            item={**self._message, "content": []}),
                self._event("response.content_part.added", **where, part=_text_part(""))]

    def _text(self, text: str) -> list[JSONObject]:
        events = self._open_message() if self._message is None else []
        self._pieces.append(text)
        where = {"item_id": self._message["id"], "output_index": len(self._items) - 1, "content_index": 0}
        return events + [self._event("response.output_text.delta", **where, delta=text, logprobs=[], **self._delta_timings)]

    def _message_text(self) -> str:
        return "".join(self._pieces) if self._message is not None else ""

    def _close_message(self, status: str) -> list[JSONObject]:
        if self._message is None:
            return []
        text, message = self._message_text(), self._message
        message.update(status=status, content=[_text_part(text)])
        self._message = None
        where = {"item_id": message["id"], "output_index": self._items.index(message), "content_index": 0}
        return [self._event("response.output_text.done", **where, text=text, logprobs=[]),
                self._event("response.content_part.done", **where, part=_text_part(text)),
                self._event("response.output_item.done", output_index=where["output_index"], item=dict(message))]

    def _thinking(self, text: str) -> list[JSONObject]:
        """Reasoning text, into the open reasoning item (opened first if none is)."""
        if not text:
            return []
        events = []
        if self._reasoning is None:
            self._reasoning = {"type": "reasoning", "id": new_id("rs"), "summary": [], "content": [],
                               "status": "in_progress"}
            self._thought = []
            self._items.append(self._reasoning)
            where = {"item_id": self._reasoning["id"], "output_index": len(self._items) - 1, "content_index": 0}
            events += [self._event("response.output_item.added", output_index=where["output_index"],
                                   item={**self._reasoning, "content": []}),
                       self._event("response.content_part.added", **where, part=_reasoning_part(""))]
        self._thought.append(text)
        where = {"item_id": self._reasoning["id"], "output_index": self._items.index(self._reasoning), "content_index": 0}
        return events + [self._event("response.reasoning_text.delta", **where, delta=text, **self._delta_timings)]

    def _close_reasoning(self, status: str) -> list[JSONObject]:
        if self._reasoning is None:
            return []
        text, item = "".join(self._thought), self._reasoning
        item.update(status=status, content=[_reasoning_part(text)])
        self._reasoning = None
        where = {"item_id": item["id"], "output_index": self._items.index(item), "content_index": 0}
        return [self._event("response.reasoning_text.done", **where, text=text),
                self._event("response.content_part.done", **where, part=_reasoning_part(text)),
                self._event("response.output_item.done", output_index=where["output_index"], item=dict(item))]

    def _call(self, call: JSONObject) -> list[JSONObject]:
        """A whole call (the reader's entry: id, name, arguments) as its item's events."""
        events = self._close_message("completed")
        name, arguments = call["function"]["name"], call["function"]["arguments"]
        item = {"type": "function_call", "id": new_id("fc"), "call_id": call["id"], "name": name, "arguments": "",
                "status": "in_progress"}
        self._items.append(item)
        where = {"item_id": item["id"], "output_index": len(self._items) - 1}
        events.append(self._event("response.output_item.added", output_index=where["output_index"], item=dict(item)))
        item.update(arguments=arguments, status="completed")
        return events + [self._event("response.function_call_arguments.delta", **where, delta=arguments),
                         self._event("response.function_call_arguments.done", **where, name=name, arguments=arguments),
                         self._event("response.output_item.done", output_index=where["output_index"], item=dict(item))]

    # the answer

    def chunk(self, delta: Delta, first: bool) -> list[JSONObject]:
        events = []
        if first:
            events += [self._event("response.created", response=self.response("in_progress")),
                       self._event("response.in_progress", response=self.response("in_progress"))]
            if self.progress is not None:
                events += [self._event("response.in_progress", response=self.response("in_progress"), prompt_progress=p)
                           for p in self.progress.events(delta)]
        if self.timings is not None and delta.token_ids:
            self._delta_timings = {"timings": self.timings.of(delta)}
        thought, text = self._counter.feed(delta.text, len(delta.token_ids), delta.finish_reason is not None)
        events += self._thinking(thought)
        if self._reader is None:
            pieces: list[str | JSONObject] = [text] if text else []
        else:
            pieces = self._reader.feed(text) + (self._reader.finish() if delta.finish_reason is not None else [])
        if pieces:
            events += self._close_reasoning("completed")
        for piece in pieces:
            events += self._text(piece) if isinstance(piece, str) else self._call(piece)
        if delta.finish_reason is not None:
            status = "incomplete" if delta.finish_reason in INCOMPLETE_REASONS else "completed"
            events += self._close_reasoning(status)
            if not any(item["type"] != "reasoning" for item in self._items):  # nothing said: one empty message, as OpenAI answers
                events += self._open_message()
            events += self._close_message(status)
            self.final = self.response(status, delta)
            timings = {"timings": llama_timings(delta)} if self.timings is not None else {}
            events.append(self._event(f"response.{status}", response=self.final, **timings))
        return events

    def whole(self, deltas: list[Delta]) -> JSONObject:
        for i, delta in enumerate(deltas):
            self.chunk(delta, i == 0)
        return self.final

    def error_event(self, error: GatewayError) -> JSONObject:
        return self._event("error", code=error.code, message=error.message, param=None)
