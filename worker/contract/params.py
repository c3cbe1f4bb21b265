"""A request's sampling parameters (torch-free: the gateway builds them, the engine runs them)."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 128  # -1: until end of generation or the context is full
    temperature: float = 0.8  # 0: greedy
    top_p: float = 0.95
    top_k: int = 40  # 0: no limit
    seed: int | None = None
    ignore_eos: bool = False  # mask end-of-generation tokens so generation runs to max_tokens
    logprobs: int | None = None  # report the top-K log-probabilities of each generated position
    echo: bool = False  # also report the prompt (and its log-probabilities with `logprobs`)
    stop: tuple[str, ...] = ()  # finish when the text contains one (it is not returned)
    stop_token_ids: tuple[int, ...] = ()  # finish on these tokens too (not returned), like end of generation

    def __post_init__(self) -> None:
        if not (math.isfinite(self.temperature) and math.isfinite(self.top_p)):
            raise ValueError(f"temperature and top_p must be finite numbers, got {self.temperature} and {self.top_p}")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise ValueError(f"seed must be between 0 and 2**63 - 1, got {self.seed}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if self.max_tokens < -1:
            raise ValueError(f"max_tokens must be >= 0 or -1, got {self.max_tokens}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must not be empty")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise ValueError(f"logprobs must be between 0 and 20, got {self.logprobs}")
