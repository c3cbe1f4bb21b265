"""The Responses API's request body (`POST /v1/responses`), validated with pydantic as the chat
body is (gateway/api/openai/protocol.py; torch-free), and what it becomes: its input as items in the
API's own shape (what is stored and listed), and the conversation as a chat body, which then
takes the chat path (tools, grammar, template).

Text only: image, file and audio parts, and tools other than functions, are refused by name with
400. `reasoning.effort` turns the template's thinking switch ("none": off), and reasoning items
sent back are an assistant turn's reasoning (docs/api.md#reasoning). Fields OpenAI defines that we
cannot honour with a non-default value (`background`, `include`, ...) are refused by name too; `user`, `truncation`, `service_tier` and
`prompt_cache_key` change nothing we compute and are ignored.
"""

from __future__ import annotations

import uuid
from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, Tag, field_validator, model_validator

from gateway.api.openai.protocol import (
    MAX_MESSAGES,
    MAX_NAME_CHARS,
    MAX_TOKENS,
    MAX_TOOLS,
    FunctionSpec,
    TemplateFields,
    _Body,
    _Generation,
)
from gateway.reasoning import Effort

FUNCTION_NAME = r"^[A-Za-z0-9_-]{1,64}$"
MAX_ARGUMENTS_CHARS = 1_000_000
MAX_METADATA_PAIRS, MAX_METADATA_KEY_CHARS, MAX_METADATA_VALUE_CHARS = 16, 64, 512  # OpenAI's
ITEM_KINDS = ("message", "function_call", "function_call_output", "reasoning")
TOOL_CHOICES = ("none", "auto", "required")
_UNSUPPORTED_AT = {"background": (None, False), "conversation": (None,), "prompt": (None,),
                   "include": (None, []), "top_logprobs": (None, 0), "max_tool_calls": (None,)}


def new_id(kind: str) -> str:
    """An id of this kind (resp, msg, fc, fco), as OpenAI spells them."""
    return f"{kind}_{uuid.uuid4().hex}"


class TextPart(_Body):
    type: Literal["input_text", "output_text"]
    text: str


def text_only(parts: Any) -> Any:
    """A content list holding only text parts, else a ValueError naming the first other part."""
    if isinstance(parts, list):
        for part in parts:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind not in ("input_text", "output_text"):
                raise ValueError(f"content part type {kind!r} is not supported by this server (text only)")
    return parts


def text_of(content: str | list[TextPart] | list[dict[str, Any]]) -> str:
    if isinstance(content, str):
        return content
    return "".join(p.text if isinstance(p, TextPart) else p["text"] for p in content)


class MessageItem(_Body):
    type: Literal["message"] = "message"
    id: str | None = Field(None, max_length=MAX_NAME_CHARS)
    role: Literal["user", "system", "developer", "assistant"]
    content: list[TextPart] | str  # the list first: its errors are the ones worth reporting

    @field_validator("content", mode="before")
    @classmethod
    def _text_only(cls, parts: Any) -> Any:
        return text_only(parts)

    def as_item(self) -> dict[str, Any]:
        kind = "output_text" if self.role == "assistant" else "input_text"
        part: dict[str, Any] = {"type": kind, "text": text_of(self.content)}
        if kind == "output_text":
            part["annotations"] = []
        return {"type": "message", "id": self.id or new_id("msg"), "role": self.role, "content": [part],
                "status": "completed"}


class FunctionCallItem(_Body):
    """An earlier answer's call, sent back in the conversation."""

    type: Literal["function_call"]
    id: str | None = Field(None, max_length=MAX_NAME_CHARS)
    call_id: str = Field(min_length=1, max_length=MAX_NAME_CHARS)
    name: str = Field(pattern=FUNCTION_NAME)
    arguments: str = Field(max_length=MAX_ARGUMENTS_CHARS)  # JSON text

    def as_item(self) -> dict[str, Any]:
        return {"type": "function_call", "id": self.id or new_id("fc"), "call_id": self.call_id, "name": self.name,
                "arguments": self.arguments, "status": "completed"}


class FunctionCallOutputItem(_Body):
    """What the client's function returned for a call."""

    type: Literal["function_call_output"]
    id: str | None = Field(None, max_length=MAX_NAME_CHARS)
    call_id: str = Field(min_length=1, max_length=MAX_NAME_CHARS)
    output: list[TextPart] | str

    @field_validator("output", mode="before")
    @classmethod
    def _text_only(cls, parts: Any) -> Any:
        return text_only(parts)

    def as_item(self) -> dict[str, Any]:
        return {"type": "function_call_output", "id": self.id or new_id("fco"), "call_id": self.call_id,
                "output": text_of(self.output), "status": "completed"}


class ReasoningText(_Body):
    type: Literal["reasoning_text", "summary_text"]
    text: str


class ReasoningItem(_Body):
    """An earlier answer's thinking, sent back (its `encrypted_content`, if any, is not ours to read)."""

    type: Literal["reasoning"]
    id: str | None = Field(None, max_length=MAX_NAME_CHARS)
    summary: list[ReasoningText] = Field(default_factory=list, max_length=MAX_MESSAGES)
    content: list[ReasoningText] | None = Field(None, max_length=MAX_MESSAGES)

    def as_item(self) -> dict[str, Any]:
        content = [part.model_dump() for part in self.content or ()]
        return {"type": "reasoning", "id": self.id or new_id("rs"), "summary": [p.model_dump() for p in self.summary],
                "content": content, "status": "completed"}


class ReasoningConfig(_Body):
    effort: Effort | None = None
    summary: str | None = Field(None, max_length=MAX_NAME_CHARS)  # ours is the thinking itself: no summary is made
    generate_summary: str | None = Field(None, max_length=MAX_NAME_CHARS)  # summary's older name


def _item_kind(value: Any) -> str | None:
    """An input item's type; a message may leave it out (OpenAI's "easy" input message)."""
    return value.get("type", "message") if isinstance(value, dict) else getattr(value, "type", None)


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")] | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")] | Annotated[ReasoningItem, Tag("reasoning")],
    Discriminator(_item_kind),
]


class FunctionTool(FunctionSpec):
    """A function tool, as the Responses API spells it (flat: no "function" wrapper)."""

    type: Literal["function"]


class NamedFunctionChoice(_Body):
    type: Literal["function"]
    name: str = Field(pattern=FUNCTION_NAME)


class TextFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = Field(None, pattern=FUNCTION_NAME)
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    description: str | None = Field(None, max_length=100_000)
    strict: bool | None = None

    @model_validator(mode="after")
    def _complete(self) -> TextFormat:
        if self.type == "json_schema" and (self.name is None or self.json_schema is None):
            raise ValueError("a json_schema format needs a 'name' and a 'schema'")
        return self

    def as_response_format(self) -> dict[str, Any]:
        """The chat body's `response_format` for this format."""
        if self.type != "json_schema":
            return {"type": self.type}
        return {"type": "json_schema", "json_schema": {"name": self.name, "schema": self.json_schema,
                                                       "strict": self.strict}}


class TextConfig(_Body):
    format: TextFormat | None = None  # `verbosity` is ignored


class ResponsesRequest(_Generation, TemplateFields):
    """`POST /v1/responses`, with our extensions every generation takes (`lora`, `cache_salt`,
    `ignore_eos`, `timeout_s`)."""

    UNSUPPORTED = _UNSUPPORTED_AT

    model: str | None = Field(None, max_length=MAX_NAME_CHARS)
    input: Annotated[list[InputItem], Field(max_length=MAX_MESSAGES)] | str
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS)  # None: the server's default
    temperature: float = Field(1.0, ge=0.0, le=2.0, allow_inf_nan=False)
    top_p: float = Field(1.0, gt=0.0, le=1.0, allow_inf_nan=False)
    stream: bool = False
    text: TextConfig | None = None
    tools: list[FunctionTool] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: NamedFunctionChoice | Literal["none", "auto", "required"] | None = None
    parallel_tool_calls: bool = True
    previous_response_id: str | None = Field(None, max_length=MAX_NAME_CHARS)
    store: bool = True
    metadata: dict[str, str] | None = Field(None, max_length=MAX_METADATA_PAIRS)
    reasoning: ReasoningConfig | None = None
    return_progress: bool = False  # llama-server's: a stream opens with response.in_progress events of prompt_progress
    timings_per_token: bool = False  # llama-server's: each streamed delta carries the timings so far

    @field_validator("input", mode="before")
    @classmethod
    def _known_items(cls, items: Any) -> Any:
        for item in items if isinstance(items, list) else ():
            kind = _item_kind(item)
            if kind not in ITEM_KINDS:
                raise ValueError(f"input item type {kind!r} is not supported by this server "
                                 f"(one of {', '.join(ITEM_KINDS)})")
        return items

    @field_validator("tools", mode="before")
    @classmethod
    def _functions_only(cls, tools: Any) -> Any:
        for tool in tools if isinstance(tools, list) else ():
            kind = tool.get("type") if isinstance(tool, dict) else None
            if kind != "function":
                raise ValueError(f"tool type {kind!r} is not supported by this server (function tools only)")
        return tools

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _function_choice(cls, choice: Any) -> Any:
        if isinstance(choice, dict) and choice.get("type") != "function":
            raise ValueError(f"tool_choice type {choice.get('type')!r} is not supported by this server (a function's)")
        if isinstance(choice, str) and choice not in TOOL_CHOICES:
            raise ValueError(f"tool_choice must be one of {', '.join(TOOL_CHOICES)} or a function, got {choice!r}")
        return choice

    @field_validator("metadata")
    @classmethod
    def _bounded_metadata(cls, metadata: dict[str, str] | None) -> dict[str, str] | None:
        for key, value in (metadata or {}).items():
            if len(key) > MAX_METADATA_KEY_CHARS or len(value) > MAX_METADATA_VALUE_CHARS:
                raise ValueError(f"metadata keys take at most {MAX_METADATA_KEY_CHARS} characters and values "
                                 f"{MAX_METADATA_VALUE_CHARS}")
        return metadata

    @model_validator(mode="after")
    def _format_or_tools(self) -> ResponsesRequest:
        has_format = self.text is not None and self.text.format is not None and self.text.format.type != "text"
        if has_format and self.tools and self.tool_choice != "none":
            raise ValueError("text.format cannot be combined with tools (give tool_choice 'none', or no tools)")
        return self

    def input_items(self) -> list[dict[str, Any]]:
        """The input as items in the API's shape, each with an id (a string: one user message)."""
        if isinstance(self.input, str):
            return [MessageItem(role="user", content=self.input).as_item()]
        return [item.as_item() for item in self.input]

    def chat_body(self, conversation: list[dict[str, Any]]) -> dict[str, Any]:
        """The chat body (gateway/api/openai/protocol.py's ChatRequest) this request amounts to, over
        `conversation`: the earlier response's items, then this request's."""
        data: dict[str, Any] = {
            "model": self.model, "messages": chat_messages(conversation, self.instructions),
            "max_tokens": self.max_output_tokens, "temperature": self.temperature, "top_p": self.top_p,
            "parallel_tool_calls": self.parallel_tool_calls, "cache_salt": self.cache_salt,
            "ignore_eos": self.ignore_eos, "timeout_s": self.timeout_s, **self.template_fields(),
        }
        if self.lora is not None:
            data["lora"] = [entry.model_dump() for entry in self.lora]
        if self.tools:
            data["tools"] = [{"type": "function", "function": tool.model_dump(exclude={"type"}, exclude_none=True)}
                             for tool in self.tools]
        if isinstance(self.tool_choice, NamedFunctionChoice):
            data["tool_choice"] = {"type": "function", "function": {"name": self.tool_choice.name}}
        elif self.tool_choice is not None:
            data["tool_choice"] = self.tool_choice
        if self.text is not None and self.text.format is not None:
            data["response_format"] = self.text.format.as_response_format()
        if self.reasoning is not None and self.reasoning.effort is not None:
            data["reasoning_effort"] = self.reasoning.effort
        return data

    def echoed(self) -> dict[str, Any]:
        """The request's parameters as the response object carries them (OpenAI's defaults filled in)."""
        fmt = self.text.format if self.text is not None and self.text.format is not None else TextFormat(type="text")
        choice = self.tool_choice.model_dump() if isinstance(self.tool_choice, NamedFunctionChoice) else self.tool_choice
        return {
            "instructions": self.instructions, "max_output_tokens": self.max_output_tokens,
            "temperature": self.temperature, "top_p": self.top_p,
            "tools": [tool.model_dump() for tool in self.tools or ()], "tool_choice": choice or "auto",
            "text": {"format": fmt.model_dump(by_alias=True, exclude_none=True)},
            "parallel_tool_calls": self.parallel_tool_calls, "previous_response_id": self.previous_response_id,
            "metadata": self.metadata or {}, "store": self.store, "truncation": "disabled", "user": None,
            "reasoning": {"effort": self.reasoning.effort if self.reasoning is not None else None, "summary": None},
        }


def chat_messages(items: list[dict[str, Any]], instructions: str | None) -> list[dict[str, Any]]:
    """Items (the API's shape) as chat messages: `instructions` as the system message first; calls
    as the tool calls of the assistant turn they follow (a turn of their own when none does);
    outputs as `tool` messages; a reasoning item's text as the `reasoning_content` of the assistant
    turn after it."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": instructions}] if instructions else []
    thought: str | None = None  # a reasoning item's text, waiting for its assistant turn
    for item in items:
        num_before = len(messages)
        if item["type"] == "reasoning":
            thought = "".join(part["text"] for part in item.get("content") or item.get("summary") or ())
        elif item["type"] == "message":
            messages.append({"role": item["role"], "content": text_of(item["content"])})
        elif item["type"] == "function_call":
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            if messages and messages[-1]["role"] == "assistant":
                messages[-1].setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        else:
            messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": item["output"]})
        if thought is not None and len(messages) > num_before and messages[-1]["role"] == "assistant":
            messages[-1]["reasoning_content"], thought = thought, None
    return messages
