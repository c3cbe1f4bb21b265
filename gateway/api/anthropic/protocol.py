"""Request bodies of the Anthropic Messages API (`/v1/messages`, `/v1/messages/count_tokens`),
validated with pydantic as the OpenAI ones are (gateway/api/openai/protocol.py, the same bounds; torch-free),
and their translation to the chat request the gateway runs (`as_chat`): tool uses become an
assistant's tool calls, tool results `tool` messages, `tool_choice` OpenAI's. A final assistant
message is a prefill the answer continues, as on chat (ChatRequest.is_prefill).

Structured outputs (`output_config.format`, or the beta's `output_format`) are enforced by grammar
as chat's `response_format` is. Extended thinking (`thinking`) turns the template's thinking switch
on or off and holds thinking to its `budget_tokens` (docs/api.md#reasoning); an assistant turn's
thinking blocks are its reasoning, templated as the model's template writes reasoning (redacted
ones, which only Anthropic can read, are dropped). What we cannot honour is refused by name with
400, never ignored: image and document blocks, MCP servers and containers. Hints that change
nothing we compute (`metadata`, `cache_control`: our prefix cache is automatic;
`output_config.effort`, `service_tier`, `speed`) are ignored.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import Field, model_validator

from gateway.api.openai.protocol import (
    MAX_LORA_ENTRIES,
    MAX_MESSAGES,
    MAX_NAME_CHARS,
    MAX_STOP,
    MAX_TOKENS,
    MAX_TOOLS,
    MAX_TOP_K,
    ChatRequest,
    LoraEntry,
    TemplateFields,
    _Body,
    stops_of,
)
from gateway.http.json_body import parse

TOOL_NAME = r"^[A-Za-z0-9_-]{1,64}$"
BLOCKS = ("text", "tool_use", "tool_result", "thinking", "redacted_thinking")  # the content blocks we take: images,
# documents... are refused
# Messages API fields we do not support, and the values that mean "not used"
_UNSUPPORTED_AT = {"mcp_servers": (None, []), "container": (None,)}


def _refuse_unsupported_blocks(content: Any) -> None:
    """ValueError naming the first block of a content list (still JSON), or of a tool result's in
    it, that is not text, a tool use or a tool result."""
    for block in content if isinstance(content, list) else ():
        kind = block.get("type") if isinstance(block, dict) else None
        if isinstance(kind, str) and kind not in BLOCKS:
            raise ValueError(f"{kind[:64]} content blocks are not supported by this server (only {', '.join(BLOCKS)})")
        if kind == "tool_result":
            _refuse_unsupported_blocks(block.get("content"))


class TextBlock(_Body):
    type: Literal["text"]
    text: str


class ToolUseBlock(_Body):
    """An earlier assistant turn's call, sent back in the conversation."""

    type: Literal["tool_use"]
    id: str = Field(max_length=MAX_NAME_CHARS)
    name: str = Field(pattern=TOOL_NAME)
    input: dict[str, Any]

    def as_openai(self) -> dict[str, Any]:
        arguments = json.dumps(self.input, ensure_ascii=False)
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": arguments}}


class ToolResultBlock(_Body):
    """What a call returned, in the user turn after it."""

    type: Literal["tool_result"]
    tool_use_id: str = Field(max_length=MAX_NAME_CHARS)
    content: list[TextBlock] | str = Field("", max_length=MAX_MESSAGES)
    is_error: bool = False

    def text(self) -> str:
        text = self.content if isinstance(self.content, str) else "".join(b.text for b in self.content)
        return f"Error: {text}" if self.is_error else text  # the model reads a failed call as one


class ThinkingBlock(_Body):
    """An earlier assistant turn's thinking (its signature is ours, or another server's: not checked)."""

    type: Literal["thinking"]
    thinking: str
    signature: str | None = Field(None, max_length=100_000)


class RedactedThinkingBlock(_Body):
    type: Literal["redacted_thinking"]
    data: str = Field(max_length=1_000_000)


ContentBlock = Annotated[TextBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock | RedactedThinkingBlock,
                         Field(discriminator="type")]


class Message(_Body):
    role: Literal["user", "assistant"]
    content: list[ContentBlock] | str = Field(max_length=MAX_MESSAGES)

    @model_validator(mode="before")
    @classmethod
    def _known_blocks(cls, data: Any) -> Any:
        _refuse_unsupported_blocks(data.get("content") if isinstance(data, dict) else None)
        return data

    @model_validator(mode="after")
    def _blocks_fit_the_role(self) -> Message:
        misplaced = ("tool_result",) if self.role == "assistant" else ("tool_use", "thinking", "redacted_thinking")
        for block in self.content if isinstance(self.content, list) else ():
            if block.type in misplaced:
                raise ValueError(f"{self.role} messages cannot hold {block.type} blocks")
        return self

    def as_chat(self) -> list[dict[str, Any]]:
        """This turn as OpenAI chat messages: an assistant's tool uses are its `tool_calls`; a user's
        tool results are `tool` messages, in order, with its text between them as user messages."""
        if isinstance(self.content, str):
            return [{"role": self.role, "content": self.content}]
        if self.role == "assistant":
            calls = [b.as_openai() for b in self.content if isinstance(b, ToolUseBlock)]
            text = "".join(b.text for b in self.content if isinstance(b, TextBlock))
            thoughts = [b.thinking for b in self.content if isinstance(b, ThinkingBlock)]
            reasoning = {"reasoning_content": "\n\n".join(thoughts)} if thoughts else {}
            return [{"role": "assistant", "content": text, **({"tool_calls": calls} if calls else {}), **reasoning}]
        out: list[dict[str, Any]] = []
        for block in self.content:
            if isinstance(block, ToolResultBlock):
                out.append({"role": "tool", "tool_call_id": block.tool_use_id, "content": block.text()})
            elif out and out[-1]["role"] == "user":
                out[-1]["content"] += block.text
            else:
                out.append({"role": "user", "content": block.text})
        return out or [{"role": "user", "content": ""}]


class Tool(_Body):
    """A client tool (Anthropic's server tools, `web_search_...` and the like, are not run here)."""

    type: Literal["custom"] | None = None
    name: str = Field(pattern=TOOL_NAME)
    description: str | None = Field(None, max_length=100_000)
    input_schema: dict[str, Any]  # a JSON Schema of the call's `input`

    def as_openai(self) -> dict[str, Any]:
        function = {"name": self.name, "description": self.description, "parameters": self.input_schema}
        return {"type": "function", "function": function}


class ToolChoice(_Body):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = Field(None, max_length=MAX_NAME_CHARS)  # type tool: the one to call
    disable_parallel_tool_use: bool = False

    @model_validator(mode="after")
    def _named_when_tool(self) -> ToolChoice:
        if (self.type == "tool") != (self.name is not None):
            raise ValueError("tool_choice takes a 'name' with type 'tool', and only then")
        return self

    def as_openai(self) -> str | dict[str, Any]:
        if self.type == "tool":
            return {"type": "function", "function": {"name": self.name}}
        return {"auto": "auto", "any": "required", "none": "none"}[self.type]


class Thinking(_Body):
    """enabled (with its budget), adaptive (the model's own measure: no budget) or disabled."""

    type: Literal["enabled", "adaptive", "disabled"]
    budget_tokens: int | None = Field(None, ge=0, le=MAX_TOKENS)
    display: str | None = Field(None, max_length=MAX_NAME_CHARS)  # summarized or omitted: ours is the thinking itself

    @model_validator(mode="after")
    def _budget_when_enabled(self) -> Thinking:
        if self.type == "enabled" and self.budget_tokens is None:
            raise ValueError("thinking.budget_tokens is required with type 'enabled'")
        return self

    def chat_fields(self) -> dict[str, Any]:
        """What it asks of chat: the template's thinking switch, and the budget."""
        if self.type == "disabled":
            return {"reasoning_effort": "none"}
        budget = {"thinking_budget_tokens": self.budget_tokens} if self.type == "enabled" else {}
        return {"reasoning_effort": "medium", **budget}


class OutputFormat(_Body):
    type: Literal["json_schema"]
    json_schema: dict[str, Any] = Field(alias="schema")  # ("schema" would shadow pydantic's method)


class OutputConfig(_Body):
    effort: str | None = Field(None, max_length=MAX_NAME_CHARS)  # how hard the model should think: a hint
    format: OutputFormat | None = None


class CountTokensRequest(TemplateFields):
    """`POST /v1/messages/count_tokens`: the conversation without what only generation takes."""

    UNSUPPORTED = _UNSUPPORTED_AT

    model: str = Field(max_length=MAX_NAME_CHARS)
    system: list[TextBlock] | str | None = Field(None, max_length=MAX_MESSAGES)
    messages: list[Message] = Field(min_length=1, max_length=MAX_MESSAGES)
    tools: list[Tool] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    output_config: OutputConfig | None = None
    output_format: OutputFormat | None = None  # the structured-outputs beta's place for it
    # our extensions, as on chat (gateway/api/openai/protocol.py)
    lora: list[LoraEntry] | None = Field(None, max_length=MAX_LORA_ENTRIES)
    cache_salt: str | None = Field(None, max_length=MAX_NAME_CHARS)

    @model_validator(mode="after")
    def _supported(self) -> CountTokensRequest:
        if self.output_format is not None and self.output_config is not None and self.output_config.format is not None:
            raise ValueError("give output_config.format or output_format, not both")
        if self.tools and self.output_schema() is not None and (self.tool_choice is None or self.tool_choice.type != "none"):
            raise ValueError("output_config.format cannot be combined with tools (give tool_choice 'none', or no tools)")
        return self

    def output_schema(self) -> dict[str, Any] | None:
        """The JSON Schema the answer's text must follow, if the body gives one."""
        given = self.output_format or (self.output_config.format if self.output_config is not None else None)
        return None if given is None else given.json_schema

    def system_text(self) -> str:
        return self.system if isinstance(self.system, str) else "".join(b.text for b in self.system or ())

    def chat_fields(self) -> dict[str, Any]:
        """The chat request's fields this body gives."""
        messages = [{"role": "system", "content": self.system_text()}] if self.system else []
        messages += [m for message in self.messages for m in message.as_chat()]
        fields: dict[str, Any] = {"model": self.model, "messages": messages, "cache_salt": self.cache_salt,
                                  **self.template_fields()}
        if self.lora is not None:
            fields["lora"] = [e.model_dump(exclude_none=True) for e in self.lora]
        if self.tools:
            fields["tools"] = [t.as_openai() for t in self.tools]
            # Anthropic's default lets an answer hold several calls
            fields["parallel_tool_calls"] = self.tool_choice is None or not self.tool_choice.disable_parallel_tool_use
        if self.tool_choice is not None:
            fields["tool_choice"] = self.tool_choice.as_openai()
        if self.output_schema() is not None:
            fields["response_format"] = {"type": "json_schema", "json_schema": {"schema": self.output_schema()}}
        if self.thinking is not None:
            fields |= self.thinking.chat_fields()
        return fields

    def as_chat(self) -> ChatRequest:
        """The chat request the gateway runs for this body (a 400 for what chat refuses of it)."""
        return parse(ChatRequest, self.chat_fields())


class MessagesRequest(CountTokensRequest):
    """`POST /v1/messages`."""

    max_tokens: int = Field(ge=1, le=MAX_TOKENS)  # required, as Anthropic's
    stop_sequences: list[str] | None = Field(None, max_length=MAX_STOP)
    temperature: float = Field(1.0, ge=0.0, le=1.0, allow_inf_nan=False)  # Anthropic's range
    top_p: float = Field(1.0, gt=0.0, le=1.0, allow_inf_nan=False)
    top_k: int = Field(0, ge=0, le=MAX_TOP_K)  # 0: off
    stream: bool = False
    metadata: dict[str, Any] | None = None  # the caller's (user_id): changes nothing we compute
    ignore_eos: bool = False  # our extension, as on chat

    @model_validator(mode="after")
    def _bounded_stops(self) -> MessagesRequest:
        stops_of(self.stop_sequences, MAX_STOP)
        budget = self.thinking.budget_tokens if self.thinking is not None and self.thinking.type == "enabled" else None
        if budget is not None and budget >= self.max_tokens:
            raise ValueError(f"max_tokens ({self.max_tokens}) must be greater than thinking.budget_tokens ({budget})")
        return self

    def chat_fields(self) -> dict[str, Any]:
        return {**super().chat_fields(), "max_tokens": self.max_tokens, "stop": self.stop_sequences,
                "temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k, "stream": self.stream,
                "ignore_eos": self.ignore_eos}
