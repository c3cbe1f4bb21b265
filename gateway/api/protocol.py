"""Request bodies of the APIs we serve (SPEC §6), validated with pydantic, and the
OpenAI-style error (torch-free).

Fields a client may send that we do not use (`user`, `logit_bias` at its
default, ...) are ignored, as OpenAI-compatible servers do; fields we cannot
honour with a non-default value (`n` > 1, penalties) are refused with 400.
"""

from __future__ import annotations

import math
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator


class APIError(Exception):
    """An error answered as `{"error": {"message", "type", "code"}}` with an HTTP status."""

    TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error", 404: "not_found_error",
             413: "invalid_request_error", 429: "rate_limit_error", 503: "service_unavailable", 500: "internal_error"}

    def __init__(self, status: int, message: str, code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.headers = status, message, code, headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.TYPES.get(self.status, "error"), "code": self.code}}


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class LoraEntry(_Body):
    id: int | None = Field(None, ge=0)
    name: str | None = None
    scale: float = 1.0

    @model_validator(mode="after")
    def _one_ref(self) -> LoraEntry:
        if (self.id is None) == (self.name is None):
            raise ValueError("each lora entry needs exactly one of 'id' and 'name'")
        if not math.isfinite(self.scale):
            raise ValueError("lora scale must be a finite number")
        return self


class StreamOptions(_Body):
    include_usage: bool = False


class _Sampling(_Body):
    model: str | None = None
    temperature: float = Field(1.0, ge=0.0, le=100.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1)  # vLLM/llama.cpp extension; 0 or -1: off
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=0, lt=2**63)
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    lora: list[LoraEntry] | None = None
    cache_salt: str | None = Field(None, max_length=256)

    @model_validator(mode="after")
    def _supported(self) -> _Sampling:
        if self.n != 1:
            raise ValueError("only n=1 is supported")
        if self.presence_penalty or self.frequency_penalty:
            raise ValueError("presence_penalty and frequency_penalty are not supported (use 0)")
        stops = self.stop_list
        if len(stops) > 4 or any(not s for s in stops):
            raise ValueError("stop takes at most 4 non-empty strings")
        return self

    @property
    def stop_list(self) -> list[str]:
        return [] if self.stop is None else [self.stop] if isinstance(self.stop, str) else list(self.stop)


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str]
    max_tokens: int | None = Field(16, ge=0)
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False

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


class ChatMessage(_Body):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[ChatContentPart] | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ChatRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=0)
    max_completion_tokens: int | None = Field(None, ge=0)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)

    @property
    def token_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class LlamaCompletionRequest(_Body):
    """llama-server's `POST /completion`."""

    prompt: str | list[int]
    n_predict: int = Field(-1, ge=-1)
    temperature: float = Field(0.8, ge=0.0, le=100.0)
    top_p: float = Field(0.95, gt=0.0, le=1.0)
    top_k: int = Field(40, ge=0)
    seed: int | None = Field(None, ge=-1, lt=2**63)  # -1: random, as llama-server
    stop: list[str] = Field(default_factory=list)
    stream: bool = False
    cache_prompt: bool = True
    ignore_eos: bool = False
    n_probs: int = Field(0, ge=0, le=20)
    lora: list[LoraEntry] | None = None
    cache_salt: str | None = Field(None, max_length=256)

    @field_validator("prompt")
    @classmethod
    def _not_empty(cls, value: str | list[int]) -> str | list[int]:
        if not value:
            raise ValueError("the prompt is empty")
        return value


class LoraScale(_Body):
    id: int = Field(ge=0)
    scale: float

    @field_validator("scale")
    @classmethod
    def _finite(cls, value: float) -> float:
        if not math.isfinite(value):
            raise ValueError("scale must be a finite number")
        return value


def parse(model: type[BaseModel], data: Any) -> Any:
    """Validate a JSON body; a bad one is a 400 naming the field."""
    try:
        return model.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(str(p) for p in err["loc"] if not isinstance(p, str) or not p.startswith(("function-", "list[", "str", "int")))
        message = err["msg"].removeprefix("Value error, ")
        raise APIError(400, f"{where}: {message}" if where else message, "invalid_value") from e
