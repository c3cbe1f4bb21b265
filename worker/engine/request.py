"""A request inside the engine (torch only through its choices' generators): as it is given
(`EngineRequest`: what the gateway checked, its adapters already this worker's slots), once the
engine has checked it (`CheckedRequest`), and each of its n choices while it runs (`Choice`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from worker.contract.identity import ScalesBySlot
from worker.contract.params import SamplingParams
from worker.engine.outputs import GenerationResult
from worker.engine.sequence import SequenceState
from worker.engine.stop import StopMatcher
from worker.formats.tokenizer import IncrementalDecoder
from worker.lora.mapping import RequestAdapters


class RequestError(ValueError):
    """The request cannot run as given (nothing was computed)."""


def kv_positions(num_prompt_tokens: int, max_tokens: int, slot_len: int) -> int:
    """KV positions a choice needs (prompt + max_tokens; -1: the whole slot); RequestError when they do not fit."""
    if max_tokens == -1:
        if num_prompt_tokens >= slot_len:
            raise RequestError(f"the prompt ({num_prompt_tokens} tokens) does not fit the context length ({slot_len})")
        return slot_len
    if num_prompt_tokens + max_tokens > slot_len:
        raise RequestError(f"the prompt ({num_prompt_tokens} tokens) plus max_tokens ({max_tokens}) "
                           f"exceeds the context length ({slot_len})")
    return num_prompt_tokens + max_tokens


@dataclass(frozen=True)
class EngineRequest:
    """A request as the engine takes it: what the gateway checked (worker/contract/calls.py), its
    adapters already turned into this worker's slots."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    scales_by_slot: ScalesBySlot = field(default_factory=dict)
    cache_salt: str = ""  # the tenant's prefix-cache namespace (docs/architecture.md#cache-keys)
    cache_prompt: bool = True  # False: neither reuse nor store this request's KV
    tenant: str = ""  # whose request: the scheduler shares prompt tokens and free slots fairly between tenants
    timeout_s: float | None = None  # its deadline, from arrival: past it, the request ends (Engine.expire)


@dataclass(frozen=True)
class CheckedRequest:
    """A request the engine has checked against what only it knows (its KV slots and their
    length, the adapters it holds): resolved once, then looked up and queued as it is."""

    request: EngineRequest
    max_len: int  # KV positions each choice needs: prompt + max_tokens
    adapters: RequestAdapters  # its slots' scales, the aLoRA's activation resolved against the prompt


@dataclass(eq=False)
class Choice:
    """One of a request's n choices while it runs."""

    request: EngineRequest
    seq: SequenceState
    adapters: RequestAdapters
    generator: torch.Generator
    decoder: IncrementalDecoder | None
    stop: StopMatcher
    result: GenerationResult
    arrived_s: float
    first_step_s: float | None = None
    first_token_s: float | None = None
    matcher: Any = None  # llguidance.LLMatcher of a request with a grammar

    @property
    def key(self) -> tuple[str, int]:
        return self.seq.key

    @property
    def deadline_s(self) -> float | None:
        return None if self.request.timeout_s is None else self.arrived_s + self.request.timeout_s

    @property
    def wants_prompt_logprobs(self) -> bool:
        return self.request.params.echo and self.request.params.logprobs is not None

    @property
    def is_at_limit(self) -> bool:
        """No token may be added (max_tokens 0)."""
        return len(self.result.token_ids) >= self.seq.max_len - self.seq.num_prompt_tokens
