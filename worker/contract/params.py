"""A request's sampling parameters (torch-free: the gateway builds them, the engine runs them)."""

from __future__ import annotations

import math
from dataclasses import dataclass

MAX_LOGIT_BIAS = 1024  # biased tokens per request, a string's tokens counted (OpenAI allows 300 entries)
MAX_CHOICES = 16  # n and best_of: choices per request (each takes a KV sequence slot of its own; a worker has few)
MAX_DRAFT_TOKENS = 16  # speculative drafts per step a request may ask for


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 128  # -1: until end of generation or the context is full
    temperature: float = 0.8  # 0: greedy
    top_p: float = 0.95
    top_k: int = 40  # 0: no limit
    seed: int | None = None
    ignore_eos: bool = False  # mask end-of-generation tokens so generation runs to max_tokens
    logprobs: int | None = None  # report the top-K log-probabilities of each generated position
    post_sampling_probs: bool = False  # ... of the distribution the token was drawn from (after every filter), not the model's
    echo: bool = False  # also report the prompt (and its log-probabilities with `logprobs`)
    stop: tuple[str, ...] = ()  # finish when the text contains one (it is not returned)
    stop_token_ids: tuple[int, ...] = ()  # finish on these tokens too (not returned), like end of generation
    # Logit processing, before greedy or sampled choice (the reported log-probabilities stay the model's).
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit); -100 or less bans the token
    presence_penalty: float = 0.0  # minus this from the logit of every token in the penalty window
    frequency_penalty: float = 0.0  # minus this times the token's count in the window
    repeat_penalty: float = 1.0  # llama.cpp's: a windowed token's logit l becomes l / p if l > 0 else l * p
    penalty_last_n: int = -1  # the window: the last n tokens of it; -1: all of them, 0: none
    penalize_prompt: bool = False  # the window spans prompt and generated tokens (llama.cpp), else generated only (OpenAI)
    min_p: float = 0.0  # sampling drops tokens less probable than min_p times the most probable one
    # top-k, top-p and min-p judged on the model's distribution (llama.cpp); False: on the tempered one (vLLM)
    temperature_last: bool = True
    grammar: str | None = None  # an llguidance grammar (worker/formats/grammar.py) every generated token must follow
    n: int = 1  # choices sampled from one prefill of the prompt; choice i's generator is seeded with seed + i
    # speculative decoding, where the worker's config turns it on: drafts per step at most (None: the worker's max_draft;
    # 0: none), and fewer than min_draft_tokens drafted are not verified (llama-server's speculative.n_max and n_min)
    max_draft_tokens: int | None = None
    min_draft_tokens: int = 0

    def choice_seed(self, index: int) -> int | None:
        return None if self.seed is None else (self.seed + index) % 2**63

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
        if not 1 <= self.n <= MAX_CHOICES:
            raise ValueError(f"n must be between 1 and {MAX_CHOICES}, got {self.n}")
        if self.max_tokens < -1:
            raise ValueError(f"max_tokens must be >= 0 or -1, got {self.max_tokens}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must not be empty")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise ValueError(f"logprobs must be between 0 and 20, got {self.logprobs}")
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise ValueError(f"logit_bias takes at most {MAX_LOGIT_BIAS} tokens, got {len(self.logit_bias)}")
        for token, bias in self.logit_bias:
            if token < 0 or not (math.isfinite(bias) and -100 <= bias <= 100):
                raise ValueError(f"logit_bias maps token ids to numbers between -100 and 100, got {token}: {bias}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not (math.isfinite(value) and -2 <= value <= 2):
                raise ValueError(f"{name} must be between -2 and 2, got {value}")
        if not (math.isfinite(self.repeat_penalty) and 0 < self.repeat_penalty <= 10):
            raise ValueError(f"repeat_penalty must be in (0, 10], got {self.repeat_penalty}")
        if self.penalty_last_n < -1:
            raise ValueError(f"penalty_last_n must be >= -1, got {self.penalty_last_n}")
        if self.max_draft_tokens is not None and not 0 <= self.max_draft_tokens <= MAX_DRAFT_TOKENS:
            raise ValueError(f"max_draft_tokens must be between 0 and {MAX_DRAFT_TOKENS}, got {self.max_draft_tokens}")
        if not 0 <= self.min_draft_tokens <= MAX_DRAFT_TOKENS:
            raise ValueError(f"min_draft_tokens must be between 0 and {MAX_DRAFT_TOKENS}, got {self.min_draft_tokens}")
        if not (math.isfinite(self.min_p) and 0 <= self.min_p <= 1):
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")

    @property
    def has_penalties(self) -> bool:
        return self.penalty_last_n != 0 and (self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repeat_penalty != 1)

    def penalty_window(self, token_ids: list[int], num_prompt_tokens: int) -> list[int]:
        """The tokens the penalties count, of a sequence's prompt + generated `token_ids`."""
        if not self.has_penalties:
            return []
        tokens = token_ids if self.penalize_prompt else token_ids[num_prompt_tokens:]
        return tokens if self.penalty_last_n == -1 else tokens[-self.penalty_last_n :]
