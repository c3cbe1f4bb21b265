"""Request bodies of the OpenAI API (completions, chat), validated with pydantic (torch-free); the
other APIs' bodies build on these.

Fields a client may send that change nothing we compute (`user`, `metadata`,
`store`, ...) are ignored, as OpenAI-compatible servers do; fields OpenAI
defines that we cannot honour with a non-default value (`audio`, `suffix`,
the deprecated `functions`, ...) are refused by name with 400, never silently
ignored.
"""

from __future__ import annotations

import json
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from gateway.reasoning import ReasoningFields
from worker.contract.params import MAX_CHOICES, MAX_DRAFT_TOKENS, MAX_LOGIT_BIAS
from worker.formats.adapter import MAX_CHAT_TEMPLATE_CHARS
from worker.formats.chat_template import RESERVED_NAMES

# Every number a client sends has a finite bound, checked here before any work (docs/api.md#limits);
# the bounds a worker shares (choices, logit biases) are the contract's (worker/contract/params.py).
MAX_ADAPTER_SCALE = 100.0  # |scale| of a request's adapter
MAX_LORA_ENTRIES = 32
MAX_STOP = 4  # OpenAI's; llama-server's /completion takes more (gateway/api/llama/protocol.py)
MAX_STOP_CHARS = 256
MAX_TOP_K = 100_000
MAX_TOKENS = 1_000_000  # and at most what fits the context (gateway/requests/admission.py)
MAX_MESSAGES = 1024
MAX_NAME_CHARS = 256  # model and adapter names, cache salts
MAX_SEED = 2**63
MAX_TOOLS = 128
MAX_TEMPLATE_KWARGS_BYTES = 64 << 10  # chat_template_kwargs, as JSON
# a message's role: a chat role, or one of an aLoRA's own (its invocation: gateway/chat_templates.py)
ROLE = r"^[A-Za-z][A-Za-z0-9_-]{0,63}$"
# OpenAI fields we do not support, and the value that means "not used"
_UNSUPPORTED_AT = {"functions": (None, []), "function_call": (None, "none", "auto"), "suffix": (None, ""),
                   "audio": (None,), "modalities": (None, ["text"]), "prediction": (None,),
                   "web_search_options": (None,)}


def refuse_unless_unused(data: Any, unused: dict[str, tuple], why: str) -> None:
    """ValueError naming the first field of a body (a dict) set to a value outside its "unused" ones."""
    if isinstance(data, dict):
        for name, values in unused.items():
            if name in data and data[name] not in values:
                raise ValueError(f"'{name}' is not supported by this server{why}")


class _Body(BaseModel):
    # strict: `false` is not 0, "1" is not 1 (a JSON number is still accepted for a float)
    model_config = ConfigDict(extra="ignore", strict=True)
    # fields of this API we do not support, and the values that mean "not used": any other is a 400 naming it
    UNSUPPORTED: ClassVar[dict[str, tuple]] = {}
    UNSUPPORTED_WHY: ClassVar[str] = ""  # said after "not supported by this server"

    @model_validator(mode="before")
    @classmethod
    def _refuse_unsupported(cls, data: Any) -> Any:
        refuse_unless_unused(data, cls.UNSUPPORTED, cls.UNSUPPORTED_WHY)
        return data


class LoraEntry(_Body):
    id: int | None = Field(None, ge=0, le=MAX_TOKENS)
    name: str | None = Field(None, max_length=MAX_NAME_CHARS)
    scale: float = Field(1.0, ge=-MAX_ADAPTER_SCALE, le=MAX_ADAPTER_SCALE, allow_inf_nan=False)

    @model_validator(mode="after")
    def _one_ref(self) -> LoraEntry:
        if (self.id is None) == (self.name is None):
            raise ValueError("each lora entry needs exactly one of 'id' and 'name'")
        return self


class StreamOptions(_Body):
    include_usage: bool = False


def stops_of(value: str | list[str] | None, most: int) -> list[str]:
    stops = [] if value is None else [value] if isinstance(value, str) else list(value)
    if len(stops) > most or any(not s or len(s) > MAX_STOP_CHARS for s in stops):
        raise ValueError(f"stop takes at most {most} non-empty strings of at most {MAX_STOP_CHARS} characters")
    return stops


class _Generation(_Body):
    """What every generation endpoint takes besides its own fields."""

    lora: list[LoraEntry] | None = Field(None, max_length=MAX_LORA_ENTRIES)
    cache_salt: str | None = Field(None, max_length=MAX_NAME_CHARS)
    ignore_eos: bool = False
    # this request's deadline (at most the server's)
    timeout_s: float | None = Field(None, gt=0, le=24 * 3600, allow_inf_nan=False)


class _Sampling(_Generation):
    UNSUPPORTED = _UNSUPPORTED_AT
    model: str | None = Field(None, max_length=MAX_NAME_CHARS)
    temperature: float = Field(1.0, ge=0.0, le=100.0, allow_inf_nan=False)
    top_p: float = Field(1.0, gt=0.0, le=1.0, allow_inf_nan=False)
    top_k: int = Field(0, ge=-1, le=MAX_TOP_K)  # vLLM/llama.cpp extension; 0 or -1: off
    n: int = Field(1, ge=1, le=MAX_CHOICES)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=0, lt=MAX_SEED)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0, allow_inf_nan=False)  # over the generated tokens, as OpenAI
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0, allow_inf_nan=False)
    # vLLM's extension (here over the generated tokens too)
    repetition_penalty: float = Field(1.0, gt=0.0, le=10.0, allow_inf_nan=False)
    min_p: float = Field(0.0, ge=0.0, le=1.0, allow_inf_nan=False)  # vLLM's extension
    logit_bias: dict[str, float] | None = Field(None, max_length=MAX_LOGIT_BIAS)
    response_format: dict[str, Any] | None = None
    # llama-server's extensions: the output follows this JSON Schema, or this GBNF grammar
    json_schema: dict[str, Any] | bool | None = None
    grammar: str | None = None
    # speculative decoding, where the worker's config turns it on: false off for this request, a number of drafts
    # per step at most (true or absent: the worker's setting)
    speculative: bool | int | None = None

    @field_validator("speculative")
    @classmethod
    def _draft_bound(cls, value: bool | int | None) -> bool | int | None:
        if not isinstance(value, bool) and value is not None and not 0 <= value <= MAX_DRAFT_TOKENS:
            raise ValueError(f"speculative is true, false or a number of drafts between 0 and {MAX_DRAFT_TOKENS}, "
                             f"got {value}")
        return value

    @property
    def max_draft_tokens(self) -> int | None:
        """`speculative` as SamplingParams takes it: None the worker's, 0 none."""
        if self.speculative is None or self.speculative is True:
            return None
        return int(self.speculative)

    @model_validator(mode="after")
    def _supported(self) -> _Sampling:
        self.grammar_source()  # checks the shape of response_format
        stops_of(self.stop, MAX_STOP)
        self.bias_pairs  # noqa: B018  (checks the keys)
        return self

    @property
    def stop_list(self) -> list[str]:
        return stops_of(self.stop, MAX_STOP)

    def grammar_source(self) -> tuple[str, Any] | None:
        """What the body asks to enforce: ("json_schema", schema), ("json_object", None), ("gbnf", text) or
        None. One of response_format, json_schema and grammar at most: two cannot both be honoured."""
        given = [name for name in ("response_format", "json_schema", "grammar") if self._asks(name)]
        if len(given) > 1:
            raise ValueError(f"give one of response_format, json_schema and grammar, not {' and '.join(given)}")
        if self.grammar is not None:
            if not self.grammar.strip():
                raise ValueError("grammar is empty")
            return "gbnf", self.grammar
        if self.json_schema is not None:
            return "json_schema", self.json_schema
        return _response_format_source(self.response_format)

    def _asks(self, name: str) -> bool:
        if name == "response_format":
            return self.response_format is not None and self.response_format.get("type") != "text"
        return getattr(self, name) is not None

    @property
    def grammar_field(self) -> str:
        """The field the enforced grammar came from (errors name it)."""
        return next((name for name in ("grammar", "json_schema") if getattr(self, name) is not None), "response_format")

    @property
    def bias_pairs(self) -> tuple[tuple[int, float], ...]:
        """logit_bias as (token id, bias): OpenAI's keys are token ids as strings."""
        pairs = []
        for key, bias in (self.logit_bias or {}).items():
            if not key.isdigit() or len(key) > 12:
                raise ValueError(f"logit_bias keys are token ids, got {key!r}")
            if not -100 <= bias <= 100:  # NaN too
                raise ValueError(f"logit_bias values must be between -100 and 100, got {bias}")
            pairs.append((int(key), float(bias)))
        return tuple(pairs)


def _response_format_source(fmt: dict[str, Any] | None) -> tuple[str, Any] | None:
    """OpenAI's response_format, and llama-server's variants: json_object with a "schema", and
    json_schema with its "schema" beside "type" rather than in a "json_schema" object."""
    if fmt is None or fmt.get("type") == "text":
        return None
    if fmt.get("type") == "json_object":
        schema = fmt.get("schema")
        if schema is None:
            return "json_object", None
        if not isinstance(schema, dict | bool):
            raise ValueError("response_format json_object's 'schema' must be a JSON Schema object")
        return "json_schema", schema
    if fmt.get("type") == "json_schema":
        spec = fmt.get("json_schema")
        if spec is None and "schema" in fmt:  # llama-server's shape
            spec = {"schema": fmt["schema"]}
        if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict | bool):
            raise ValueError("response_format json_schema needs a 'json_schema' object with a 'schema'")
        return "json_schema", spec.get("schema", {})
    raise ValueError(f"response_format type must be 'text', 'json_object' or 'json_schema', got {fmt.get('type')!r}")


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str]
    max_tokens: int | None = Field(16, ge=0, le=MAX_TOKENS)  # null: the server's default
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False
    # sample this many, answer the n of highest mean token log-probability
    best_of: int | None = Field(None, ge=1, le=MAX_CHOICES)

    @model_validator(mode="after")
    def _best_of(self) -> CompletionRequest:
        if self.best_of is not None and self.best_of < self.n:
            raise ValueError(f"best_of ({self.best_of}) must be at least n ({self.n})")
        if self.best_of is not None and self.best_of > 1 and self.stream:
            raise ValueError("best_of cannot be streamed")
        return self

    @property
    def num_samples(self) -> int:
        return self.best_of or self.n

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, value: str | list) -> str | list[int]:
        if isinstance(value, list) and value and isinstance(value[0], str):
            if len(value) != 1:
                raise ValueError("one prompt per request (got a list of several)")
            return value[0]
        if isinstance(value, list) and not value or value == "":
            raise ValueError("the prompt is empty")
        return value


class ChatContentPart(_Body):
    type: Literal["text"]
    text: str


class FunctionCall(_Body):
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    arguments: str = Field(max_length=1_000_000)  # JSON text


class ToolCallIn(_Body):
    """An earlier assistant turn's call, sent back in the conversation."""

    id: str = Field(max_length=MAX_NAME_CHARS)
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Body):
    role: str = Field(pattern=ROLE)
    content: str | list[ChatContentPart] | None = None
    tool_calls: list[ToolCallIn] | None = Field(None, max_length=MAX_TOOLS)  # an assistant's calls
    tool_call_id: str | None = Field(None, max_length=MAX_NAME_CHARS)  # a tool message: the call it answers
    name: str | None = Field(None, max_length=MAX_NAME_CHARS)
    reasoning_content: str | None = None  # an earlier assistant turn's thinking, as the template reads it

    def text(self) -> str:
        if self.content is None:
            return ""
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.tool_calls:
            out["tool_calls"] = [c.model_dump() for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            out["name"] = self.name
        if self.reasoning_content is not None and self.role == "assistant":
            out["reasoning_content"] = self.reasoning_content
        return out


class FunctionSpec(_Body):
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = Field(None, max_length=100_000)
    parameters: dict[str, Any] | None = None  # a JSON Schema; absent: no arguments
    strict: bool | None = None


class ToolSpec(_Body):
    type: Literal["function"]
    function: FunctionSpec


class NamedFunction(_Body):
    name: str = Field(max_length=MAX_NAME_CHARS)


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: NamedFunction


class Continuation(_Body):
    """How a chat's rendering ends. A last assistant message is a prefill the answer continues
    (llama-server's rule; vLLM's `continue_final_message` asks for it by name), unless
    `add_generation_prompt` is false, which renders the messages as they are."""

    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    add_generation_prompt: bool | None = None
    continue_final_message: bool = False

    @model_validator(mode="after")
    def _continuation(self) -> Continuation:
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt cannot both be true")
        if self.continue_final_message and self.messages[-1].role != "assistant":
            raise ValueError("continue_final_message needs the last message to be the assistant's")
        if self.is_prefill and self.messages[-1].tool_calls:
            raise ValueError("an assistant message with tool_calls cannot be continued")
        if self.is_prefill and len(self.messages) > 1 and self.messages[-2].role == "assistant":
            raise ValueError("two assistant messages end the conversation: only the last one can be continued")
        return self

    @property
    def is_prefill(self) -> bool:
        """The last message is the assistant's text, which the answer continues."""
        last = self.messages[-1]
        if self.continue_final_message:
            return True
        return last.role == "assistant" and not last.tool_calls and self.add_generation_prompt is not False


class TemplateFields(_Body):
    """What a chat body may ask of its chat template (docs/api.md#chat-templates): a template of its
    own (where the operator allows it: http.allow_request_chat_template) and more template variables."""

    chat_template: str | None = Field(None, min_length=1, max_length=MAX_CHAT_TEMPLATE_CHARS)
    chat_template_kwargs: dict[str, Any] | None = None

    @field_validator("chat_template_kwargs")
    @classmethod
    def _bounded_kwargs(cls, kwargs: dict[str, Any] | None) -> dict[str, Any] | None:
        if kwargs is None:
            return None
        taken = sorted(RESERVED_NAMES.intersection(kwargs))
        if taken:
            raise ValueError(f"{taken[0]!r} is set by the server, not by chat_template_kwargs")
        if len(json.dumps(kwargs, ensure_ascii=False).encode()) > MAX_TEMPLATE_KWARGS_BYTES:
            raise ValueError(f"chat_template_kwargs take at most {MAX_TEMPLATE_KWARGS_BYTES} bytes as JSON")
        return kwargs

    def template_fields(self) -> dict[str, Any]:
        """These fields as a chat body gives them (the Anthropic and Responses bodies pass them on)."""
        return {name: value for name, value in (("chat_template", self.chat_template),
                                                ("chat_template_kwargs", self.chat_template_kwargs)) if value is not None}


class ChatRequest(_Sampling, Continuation, TemplateFields, ReasoningFields):
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_tokens: int | None = Field(None, ge=0, le=MAX_TOKENS)
    max_completion_tokens: int | None = Field(None, ge=0, le=MAX_TOKENS)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[ToolSpec] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None  # true: an answer may hold several calls (default: one)
    return_progress: bool = False  # llama-server's: a stream opens with prompt_progress chunks
    timings_per_token: bool = False  # llama-server's: each streamed chunk of tokens carries the timings so far

    @model_validator(mode="after")
    def _tools(self) -> ChatRequest:
        forced = self.tool_choice not in (None, "none", "auto")
        if forced and not self.tools:
            raise ValueError("tool_choice requires tools")
        if self.tools and self.tool_choice != "none" and self.grammar_source() is not None:
            given = next(name for name in ("response_format", "json_schema", "grammar") if self._asks(name))
            raise ValueError(f"{given} cannot be combined with tools (give tool_choice 'none', or no tools)")
        return self

    @property
    def token_limit(self) -> int | None:
        """The completion's limit; None: the server's default."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
