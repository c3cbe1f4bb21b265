"""One answered request's usage, as the ledger (gateway/tenancy/usage.py) counts it per tenant, key,
adapter, model and hour (torch-free)."""

from __future__ import annotations

from dataclasses import dataclass

COUNTS = ("requests", "prompt_tokens", "cached_tokens", "completion_tokens")
FINISH_REASONS = ("stop", "length", "tool_calls", "cancelled", "error")


@dataclass(frozen=True)
class UsageEvent:
    """One answered request's usage."""

    request_id: str
    tenant: str
    key_id: str
    adapter: str  # the adapters it used, as its tenant named them ("base": none)
    model: str
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    finish_reason: str  # stop, length, tool_calls, cancelled, error
    at_s: float  # wall-clock time it ended (its hour)
    admitted_s: float | None = None  # when its quota reservation was made: its day and month (None: at_s's)

    @property
    def tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    @property
    def quota_at_s(self) -> float:
        return self.at_s if self.admitted_s is None else self.admitted_s

    def counts(self) -> dict[str, int]:
        finish = self.finish_reason if self.finish_reason in FINISH_REASONS else "stop"
        return {"requests": 1, "prompt_tokens": self.prompt_tokens, "cached_tokens": self.cached_tokens,
                "completion_tokens": self.completion_tokens, f"finish_{finish}": 1}
