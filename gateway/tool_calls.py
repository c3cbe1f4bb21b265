"""Tool calling on chat (torch-free): how a request's tools reach the model, how its calls are
enforced, and how they are read back out of the generated text.

Two styles, picked by the model's chat template:
- **hermes**: a template that renders `tools` itself and writes calls as
  `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (Qwen 2.5/3, Hermes and their
  fine-tunes). The tools go to the template; assistant calls and `tool` messages go back in
  OpenAI's shape, arguments as objects (what these templates read).
- **generic**, for every other template (the default SmolLM2's has no tool support), as
  llama-server does for such templates: a system message lists the functions and asks for
  JSON, `{"tool_call": {"name": ..., "arguments": {...}}}` (or `{"tool_calls": [...]}` with
  `parallel_tool_calls`) or `{"response": "..."}`. The answer is always held to that shape by
  the grammar engine. Earlier calls are written back as that JSON in the assistant's turn and
  tool results as a user turn `{"tool_response": {"name": ..., "content": ...}}`.

`tool_choice` `required` or a named function is enforced by the grammar in both styles: the
answer is a call of an allowed function with arguments that match its `parameters` schema.
`auto` leaves a hermes model free (its calls are parsed when they are well formed) and holds a
generic one to "call or respond". `none` renders no tools at all.

No library fits: the tool-call parsers of vLLM and SGLang are parts of those servers, and the
grammar work itself is llguidance's (worker/formats/grammar.py).
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from worker.formats.grammar import JSON_OPTIONS, gbnf_grammar, json_schema_grammar

GENERIC, HERMES = "generic", "hermes"
OPEN, CLOSE = "<tool_call>", "</tool_call>"
_EMPTY_PARAMETERS = {"type": "object", "properties": {}}
_BLOCK = re.compile(re.escape(OPEN) + r"\s*(.*?)\s*" + re.escape(CLOSE), re.DOTALL)


def template_style(chat_template: str | None) -> str:
    """hermes when the template renders `tools` and writes `<tool_call>` blocks, else generic."""
    return HERMES if chat_template and "tools" in chat_template and OPEN in chat_template else GENERIC


@dataclass(frozen=True)
class Function:
    name: str
    description: str
    parameters: dict[str, Any]

    def as_tool(self) -> dict[str, Any]:
        function = {"name": self.name, "description": self.description, "parameters": self.parameters}
        return {"type": "function", "function": function}

    def call_schema(self, pointer: str) -> dict[str, Any]:
        """{"name", "arguments"} of a call of this function, for a schema placed at JSON pointer
        `pointer` of the whole: the parameters' own references ("#/$defs/...") are rebased there."""
        arguments = _rebased(self.parameters, f"{pointer}/properties/arguments")
        return {"type": "object", "properties": {"name": {"const": self.name}, "arguments": arguments},
                "required": ["name", "arguments"], "additionalProperties": False}


def _rebased(schema: Any, pointer: str) -> Any:
    """A copy of `schema` with its local references ("#/...") made to point below `pointer`."""
    if isinstance(schema, dict):
        return {k: "#" + pointer + v[1:] if k == "$ref" and isinstance(v, str) and v.startswith("#")
                else _rebased(v, pointer) for k, v in schema.items()}
    if isinstance(schema, list):
        return [_rebased(v, pointer) for v in schema]
    return schema


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text, as OpenAI sends it

    def as_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def _loads(text: str) -> Any:
    """JSON text -> value; ValueError for anything that is not JSON, nested too deep included."""
    try:
        return json.loads(text)
    except RecursionError:
        raise ValueError("JSON nested too deep") from None


def _call_of(data: Any, names: set[str]) -> ToolCall | None:
    """A parsed {"name", "arguments"} object as a call of a known function, else None."""
    if not isinstance(data, dict) or not isinstance(data.get("name"), str) or data["name"] not in names:
        return None
    arguments = data.get("arguments", data.get("parameters", {}))
    if isinstance(arguments, str):
        try:
            arguments = _loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ToolCall(f"call_{uuid.uuid4().hex[:24]}", data["name"], json.dumps(arguments, ensure_ascii=False))


class ToolPlan:
    """One request's tools: how they are rendered, enforced and read back."""

    def __init__(self, functions: Sequence[Function], choice: str | None, parallel: bool, style: str) -> None:
        self.functions, self.choice, self.parallel, self.style = list(functions), choice or "auto", parallel, style
        self.names = {f.name for f in self.functions}

    @property
    def is_forced(self) -> bool:
        return self.choice != "auto"

    def allowed(self) -> list[Function]:
        if self.choice in ("auto", "required"):
            return self.functions
        return [f for f in self.functions if f.name == self.choice]

    # to the model

    def system_text(self) -> str:
        """The generic style's description of the tools (a system message)."""
        shape = ('{"tool_calls": [{"name": "<function name>", "arguments": {<its arguments>}}, ...]}' if self.parallel
                 else '{"tool_call": {"name": "<function name>", "arguments": {<its arguments>}}}')
        listing = "\n".join(json.dumps(f.as_tool()["function"], ensure_ascii=False) for f in self.allowed())
        if self.is_forced:
            ask = f"Respond in JSON format with a call of one of these tools: {shape}"
        else:
            ask = (f"Respond in JSON format, either with a call of a tool: {shape}, "
                   'or with a reply to the user: {"response": "<your reply>"}')
        return f"You can use these tools:\n{listing}\n\n{ask}"

    def template_tools(self) -> list[dict[str, Any]]:
        return [f.as_tool() for f in self.allowed()]

    def grammar(self) -> str | None:
        """The llguidance grammar the answer must follow (GrammarError naming the failing schema)."""
        allowed = self.allowed()

        def calls(at: str) -> dict[str, Any]:  # a call of any allowed function, placed at pointer `at`
            if len(allowed) == 1:
                return allowed[0].call_schema(at)
            return {"anyOf": [f.call_schema(f"{at}/anyOf/{i}") for i, f in enumerate(allowed)]}

        if self.style == HERMES:
            if not self.is_forced:
                return None
            block = f'"{OPEN}\\n" call "\\n{CLOSE}"'
            body = json.dumps({**calls(""), "x-guidance": JSON_OPTIONS})
            start = f'{block} ("\\n" {block})*' if self.parallel else block
            return gbnf_grammar(f"start: {start}\ncall: %json {body}")
        key = "tool_calls" if self.parallel else "tool_call"
        root = "" if self.is_forced else "/anyOf/0"
        if self.parallel:
            value = {"type": "array", "items": calls(f"{root}/properties/{key}/items"), "minItems": 1}
        else:
            value = calls(f"{root}/properties/{key}")
        schema: dict[str, Any] = {"type": "object", "properties": {key: value}, "required": [key],
                                  "additionalProperties": False}
        if not self.is_forced:
            reply = {"type": "object", "properties": {"response": {"type": "string"}}, "required": ["response"],
                     "additionalProperties": False}
            schema = {"anyOf": [schema, reply]}
        return json_schema_grammar(schema)

    # back from the model

    def reader(self) -> ToolReader:
        return ToolReader(self)

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """A whole answer as (content, calls); content is None when there are calls and nothing else."""
        reader = self.reader()
        events = reader.feed(text) + reader.finish()
        calls = [ToolCall(e["id"], e["function"]["name"], e["function"]["arguments"])
                 for e in events if isinstance(e, dict)]
        content = "".join(e for e in events if isinstance(e, str))
        return (content or None) if calls else content, calls


class ToolReader:
    """One choice's text as it streams: content pieces (str) and complete calls (OpenAI's streamed
    tool-call entries, each whole: index, id, type, name and arguments). Whitespace that touches a
    call, or the start or end of the answer, is dropped, so the pieces join to what `parse` gives."""

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        self.num_calls = 0
        self._pending = ""  # text not yet read (a block in progress, or what may start one)
        self._in_call = False
        self._blank = ""  # whitespace held back until text follows it
        self._at_edge = True  # nothing emitted yet, or a call last

    def _emit(self, events: list[str | dict[str, Any]], piece: str | ToolCall) -> None:
        if isinstance(piece, ToolCall):
            self.num_calls += 1
            events.append({"index": self.num_calls - 1, **piece.as_openai()})
            self._blank, self._at_edge = "", True
            return
        text = self._blank + piece
        if self._at_edge:
            text = text.lstrip()
        body = text.rstrip()
        self._blank = text[len(body) :]
        if body:
            events.append(body)
            self._at_edge = False

    def feed(self, text: str) -> list[str | dict[str, Any]]:
        self._pending += text
        events: list[str | dict[str, Any]] = []
        if self.plan.style == GENERIC:  # one JSON value: read once it is complete
            return events
        while True:
            if not self._in_call:
                at = self._pending.find(OPEN)
                if at < 0:  # hold back what may be the start of a block
                    longest = min(len(OPEN) - 1, len(self._pending))
                    keep = next((n for n in range(longest, 0, -1) if OPEN.startswith(self._pending[-n:])), 0)
                    cut = len(self._pending) - keep
                    self._emit(events, self._pending[:cut])
                    self._pending = self._pending[cut:]
                    return events
                self._emit(events, self._pending[:at])
                self._pending, self._in_call = self._pending[at:], True
            end = self._pending.find(CLOSE)
            if end < 0:
                return events
            end += len(CLOSE)
            block, self._pending, self._in_call = self._pending[:end], self._pending[end:], False
            self._emit(events, self._block(block) or block)

    def _block(self, block: str) -> ToolCall | None:
        match = _BLOCK.fullmatch(block.strip())
        try:
            return _call_of(_loads(match.group(1)), self.plan.names) if match else None
        except ValueError:
            return None

    def finish(self) -> list[str | dict[str, Any]]:
        rest, self._pending = self._pending, ""
        events: list[str | dict[str, Any]] = []
        if self.plan.style == HERMES:
            left_open = self._block(rest + CLOSE) if self._in_call else None  # a block left open by the end
            self._emit(events, left_open or rest)
            self._in_call = False
            return events
        try:
            data = _loads(rest)
        except ValueError:  # cut short (max_tokens): the text as it is
            data = None
        if isinstance(data, dict) and isinstance(data.get("response"), str):
            self._emit(events, data["response"])
            return events
        if not isinstance(data, dict):
            items = None
        else:
            items = data.get("tool_calls") if "tool_calls" in data else [data.get("tool_call")]
        calls = [_call_of(item, self.plan.names) for item in items] if isinstance(items, list) and items else []
        if calls and all(c is not None for c in calls):
            for call in calls:
                self._emit(events, call)
        else:
            self._emit(events, rest)
        return events


def plan_of(body, style: str) -> ToolPlan | None:
    """A chat body's tools (None when it has none, or tool_choice is none); 400s as ValueError."""
    choice = body.tool_choice
    if not body.tools or choice == "none":
        return None
    functions = [Function(t.function.name, t.function.description or "",
                          t.function.parameters or dict(_EMPTY_PARAMETERS)) for t in body.tools]
    if len({f.name for f in functions}) < len(functions):
        raise ValueError("tools: function names must be unique")
    if isinstance(choice, Mapping) or hasattr(choice, "function"):
        name = choice["function"]["name"] if isinstance(choice, Mapping) else choice.function.name
        if name not in {f.name for f in functions}:
            raise ValueError(f"tool_choice names function {name!r}, which is not in tools")
        choice = name
    return ToolPlan(functions, choice, bool(body.parallel_tool_calls), style)


def chat_messages(messages: Sequence[Mapping[str, Any]], plan: ToolPlan | None, style: str) -> list[dict[str, Any]]:
    """OpenAI chat messages (plain dicts: role, content, tool_calls, tool_call_id) as the template
    reads them in this style, with the generic style's tool description first."""
    names: dict[str, str] = {}  # tool_call_id -> function name, from earlier assistant turns
    out: list[dict[str, Any]] = []
    for m in messages:
        role, content = m["role"], m.get("content") or ""
        calls = m.get("tool_calls") or []
        for call in calls:
            names[call["id"]] = call["function"]["name"]
        if role == "assistant" and calls:
            parsed = [{"name": c["function"]["name"], "arguments": _arguments(c["function"]["arguments"])}
                      for c in calls]
            if style == HERMES:
                out.append({"role": "assistant", "content": content,
                            "tool_calls": [{"id": c["id"], "type": "function", "function": p}
                                           for c, p in zip(calls, parsed)]})
            else:
                data = {"tool_calls": parsed} if len(parsed) > 1 else {"tool_call": parsed[0]}
                out.append({"role": "assistant", "content": json.dumps(data, ensure_ascii=False)})
        elif role == "tool":
            name = names.get(m.get("tool_call_id") or "", m.get("name") or "")
            if style == HERMES:
                out.append({"role": "tool", "content": content, "tool_call_id": m.get("tool_call_id"), "name": name})
            else:
                response = {"tool_response": {"name": name, "content": content}}
                out.append({"role": "user", "content": json.dumps(response, ensure_ascii=False)})
        else:
            out.append({"role": role, "content": content})
        if role == "assistant" and m.get("reasoning_content") is not None:
            out[-1]["reasoning_content"] = m["reasoning_content"]  # its thinking, as Qwen3's template reads it
    if plan is not None and style == GENERIC:
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{plan.system_text()}"}
        else:
            out.insert(0, {"role": "system", "content": plan.system_text()})
    return out


def _arguments(text: str) -> Any:
    try:
        return _loads(text)
    except ValueError:
        raise ValueError(f"an assistant tool call's arguments are not JSON: {text[:80]!r}") from None


def chat_input(body, style: str) -> tuple[ToolPlan | None, list[dict[str, Any]], dict[str, Any]]:
    """A chat body's tool plan, its messages as the template reads them in this style, and what
    else rendering gets (`tools`, in the hermes style; `continue_final` for a prefill, or
    `add_generation_prompt` false: worker/formats/chat_template.py); ValueError for a bad body."""
    plan = plan_of(body, style) if getattr(body, "tools", None) else None
    messages = chat_messages([m.as_dict() for m in body.messages], plan, style)
    extra: dict[str, Any] = {"tools": plan.template_tools()} if plan is not None and style == HERMES else {}
    if getattr(body, "is_prefill", False):
        extra["continue_final"] = True
    elif getattr(body, "add_generation_prompt", None) is False:
        extra["add_generation_prompt"] = False
    return plan, messages, extra


def rendered_size(messages: list[dict[str, Any]], extra: dict[str, Any]) -> int:
    """What the template renders, in characters: the contents, the tools, and earlier calls."""
    calls = sum(len(json.dumps(m["tool_calls"])) for m in messages if m.get("tool_calls"))
    calls += sum(len(m.get("reasoning_content") or "") for m in messages)
    return sum(len(m["content"]) for m in messages) + calls + sum(len(json.dumps(t)) for t in extra.get("tools", ()))
