"""Request bodies of llama-server's API (`/completion`, `/tokenize`, `/detokenize`, `/apply-template`,
`/lora-adapters`), validated with pydantic as the OpenAI ones are (gateway/api/openai/protocol.py; torch-free).

llama.cpp samplers we do not run are refused by name when a request turns one on; at their "off"
values they are accepted, as are llama-server's own sampler orders where the ones we run keep ours.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from gateway.api.openai.protocol import (
    MAX_ADAPTER_SCALE,
    MAX_LORA_ENTRIES,
    MAX_MESSAGES,
    MAX_NAME_CHARS,
    MAX_SEED,
    MAX_TOKENS,
    MAX_TOOLS,
    MAX_TOP_K,
    ChatMessage,
    Continuation,
    LoraEntry,
    NamedToolChoice,
    TemplateFields,
    ToolSpec,
    _Body,
    _Generation,
    stops_of,
)
from worker.contract.params import MAX_DRAFT_TOKENS, MAX_LOGIT_BIAS

MAX_LLAMA_STOP = 16
# llama-server sampler fields we do not run, and the values that leave them off
_LLAMA_OFF = {"mirostat": (0, None), "dynatemp_range": (0, 0.0, None), "top_n_sigma": (-1, -1.0, 0, 0.0, None),
              "xtc_probability": (0, 0.0, None), "typical_p": (1, 1.0, None), "dry_multiplier": (0, 0.0, None),
              "min_keep": (0, None), "grammar_lazy": (False, None)}
# llama-server's sampler names (and the letters of its string form); those we run must come in our order
_LLAMA_SAMPLERS = {"e": "penalties", "d": "dry", "s": "top_n_sigma", "k": "top_k", "y": "typ_p", "p": "top_p",
                   "m": "min_p", "x": "xtc", "t": "temperature"}
_OUR_ORDER = ["top_k", "top_p", "min_p", "temperature"]


def _samplers_we_run_in_order(value: Any) -> bool:
    """A `samplers` value whose samplers we run come in our order (the others are off unless asked for)."""
    if isinstance(value, str):
        if any(c not in _LLAMA_SAMPLERS for c in value):
            return False
        value = [_LLAMA_SAMPLERS[c] for c in value]
    if not isinstance(value, list) or any(not isinstance(v, str) or v not in _LLAMA_SAMPLERS.values() for v in value):
        return False
    return [v for v in value if v in _OUR_ORDER] == _OUR_ORDER


MAX_PROMPTS = 16  # in one /completion batch
Piece = str | int  # of a prompt: text (tokenized) or a token id (kept)
_PROMPT_SHAPES = ("expected a string, a list of token ids, a list mixing strings and token ids, an object with a "
                  "'prompt_string', or a list of such prompts (a batch)")


def _pieces(value: Any) -> list[Piece]:
    """One prompt as its pieces, as llama-server reads one."""
    if isinstance(value, dict):
        if "multimodal_data" in value:
            raise ValueError("multimodal_data is not supported (this server's model takes text)")
        value = value.get("prompt_string")
    if isinstance(value, str):
        pieces: list[Any] = [value]
    elif isinstance(value, list) and len(value) <= MAX_TOKENS:
        pieces = value
    else:
        raise ValueError(_PROMPT_SHAPES)
    for piece in pieces:
        if isinstance(piece, bool) or not isinstance(piece, str | int):
            raise ValueError(f"{_PROMPT_SHAPES}; got an element {json.dumps(piece)[:40]}")
        if isinstance(piece, int) and piece < 0:
            raise ValueError(f"prompt token ids are not negative, got {piece}")
    if all(piece == "" for piece in pieces):
        raise ValueError("the prompt is empty")
    return pieces


def prompts_of(value: Any) -> list[list[Piece]]:
    """A /completion `prompt` as its prompts: a list holding no token id is a batch, one prompt an
    element (llama-server's rule); anything else is one prompt."""
    if isinstance(value, list) and not value:
        raise ValueError("the prompt is empty")
    is_batch = isinstance(value, list) and not any(isinstance(p, int) and not isinstance(p, bool) for p in value)
    items = value if is_batch else [value]
    if len(items) > MAX_PROMPTS:
        raise ValueError(f"a batch takes at most {MAX_PROMPTS} prompts, got {len(items)}")
    return [_pieces(item) for item in items]


class LlamaCompletionRequest(_Generation):
    """llama-server's `POST /completion` (and `/completions`)."""

    UNSUPPORTED, UNSUPPORTED_WHY = _LLAMA_OFF, " (its samplers: penalties, top_k, top_p, min_p, temperature)"

    prompt: str | list[Any] | dict[str, Any]  # see prompts_of
    # absent: the server's default; -1: until the end of generation
    n_predict: int | None = Field(None, ge=-1, le=MAX_TOKENS)
    temperature: float = Field(0.8, ge=0.0, le=100.0, allow_inf_nan=False)
    top_p: float = Field(0.95, gt=0.0, le=1.0, allow_inf_nan=False)
    top_k: int = Field(40, ge=0, le=MAX_TOP_K)
    seed: int | None = Field(None, ge=-1, lt=MAX_SEED)  # -1: random, as llama-server
    stop: list[str] = Field(default_factory=list)
    stream: bool = False
    cache_prompt: bool = True
    n_probs: int = Field(0, ge=0, le=20)
    # llama.cpp's sampler defaults; its penalties count the last repeat_last_n tokens of prompt and output
    min_p: float = Field(0.05, ge=0.0, le=1.0, allow_inf_nan=False)
    repeat_penalty: float = Field(1.0, gt=0.0, le=10.0, allow_inf_nan=False)
    repeat_last_n: int = Field(64, ge=-1, le=MAX_TOKENS)  # -1: the whole context, 0: off
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0, allow_inf_nan=False)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0, allow_inf_nan=False)
    # [[token, bias], ...] or {"token": bias}; a token is an id or a string (each of its tokens); bias false bans
    logit_bias: list[list[Any]] | dict[str, Any] | None = Field(None, max_length=MAX_LOGIT_BIAS)
    # speculative decoding, where the worker's config turns it on: drafts per step at most, and fewer are not verified
    speculative_n_max: int | None = Field(None, alias="speculative.n_max", ge=0, le=MAX_DRAFT_TOKENS)
    speculative_n_min: int = Field(0, alias="speculative.n_min", ge=0, le=MAX_DRAFT_TOKENS)

    def bias_entries(self) -> list[tuple[int | str, float]]:
        """(token id or text, bias) with `false` as -100 (a ban)."""
        raw = self.logit_bias or []
        items = list(raw.items()) if isinstance(raw, dict) else raw
        entries = []
        for item in items:
            if isinstance(item, tuple | list) and len(item) == 2:
                token, bias = item
            else:
                raise ValueError("logit_bias entries are [token, bias] pairs")
            if isinstance(raw, dict) and isinstance(token, str) and token.lstrip("-").isdigit():
                token = int(token)
            if bias is False:
                bias = -100.0
            if isinstance(bias, bool) or not isinstance(bias, int | float) or not -100 <= bias <= 100:
                raise ValueError(f"logit_bias values are numbers between -100 and 100 or false, got {bias!r}")
            if isinstance(token, bool) or not isinstance(token, int | str) or (isinstance(token, int) and token < 0):
                raise ValueError(f"logit_bias tokens are token ids or strings, got {token!r}")
            entries.append((token, float(bias)))
        return entries

    json_schema: dict[str, Any] | bool | None = None  # the output follows this JSON Schema
    grammar: str | None = None  # or this GBNF grammar
    # n_probs of the distribution each token was drawn from (after the sampler's filters)
    post_sampling_probs: bool = False
    return_tokens: bool = False  # list the generated token ids in `tokens` (streamed events always do)
    # keep only these fields of the answer ("generation_settings/n_predict": a field of a field)
    response_fields: list[str] = Field(default_factory=list, max_length=64)
    return_progress: bool = False  # a stream opens with prompt_progress events
    timings_per_token: bool = False  # each streamed token's event carries the timings so far

    @model_validator(mode="before")
    @classmethod
    def _samplers_in_our_order(cls, data: Any) -> Any:
        if isinstance(data, dict):
            if data.get("samplers") is not None and not _samplers_we_run_in_order(data["samplers"]):
                raise ValueError("'samplers' is supported only in this server's order: penalties, top_k, top_p, min_p, "
                                 "temperature")
        return data

    @model_validator(mode="after")
    def _check_bias(self) -> LlamaCompletionRequest:
        self.bias_entries()
        if self.json_schema is not None and self.grammar:
            raise ValueError("give either json_schema or grammar, not both")
        return self

    def grammar_source(self) -> tuple[str, Any] | None:
        if self.grammar:
            return "gbnf", self.grammar
        return ("json_schema", self.json_schema) if self.json_schema is not None else None

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_shape(cls, value: Any) -> Any:
        prompts_of(value)  # a clear message for a wrong shape, before pydantic's union names its members
        return value

    def prompts(self) -> list[list[Piece]]:
        return prompts_of(self.prompt)

    @field_validator("stop")
    @classmethod
    def _bounded_stops(cls, value: list[str]) -> list[str]:
        return stops_of(value, MAX_LLAMA_STOP)


class TokenizeRequest(_Body):
    """llama-server's `POST /tokenize`: `content` a string, or a list mixing strings and token ids (kept)."""

    content: str | list[Any] = Field(max_length=4_000_000)
    add_special: bool = False  # the BOS (where the model adds one), before content that starts with text
    parse_special: bool = True
    with_pieces: bool = False

    @field_validator("content")
    @classmethod
    def _mixed(cls, value: str | list[Any]) -> str | list[Any]:
        return value if isinstance(value, str) else _pieces(value)

    def pieces(self) -> list[Piece]:
        return [self.content] if isinstance(self.content, str) else self.content


class DetokenizeRequest(_Body):
    tokens: list[int] = Field(max_length=MAX_TOKENS)


class ApplyTemplateRequest(Continuation, TemplateFields):
    """llama-server's `POST /apply-template`: a chat body's messages and tools, rendered (a last
    assistant message as the prefill a chat would continue) as a chat with the same adapters would be
    (`model`, `lora`: our extensions, as on chat; none: the key's default scales)."""

    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    tools: list[ToolSpec] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    model: str | None = Field(None, max_length=MAX_NAME_CHARS)
    lora: list[LoraEntry] | None = Field(None, max_length=MAX_LORA_ENTRIES)


class LoraScale(_Body):
    id: int = Field(ge=0, le=MAX_TOKENS)
    scale: float = Field(ge=-MAX_ADAPTER_SCALE, le=MAX_ADAPTER_SCALE, allow_inf_nan=False)
