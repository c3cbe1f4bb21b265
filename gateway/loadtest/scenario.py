"""A load-test scenario (YAML), validated with pydantic: who sends what, how often.

Prompts are token ids (sent to /v1/completions), so the tool knows exactly which
chunks repeat and can compute the ideal cache-hit share of the scenario.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from cache.prefix import PrefixCacheConfig
from gateway.config import ConfigError, describe_errors, read_yaml


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class TenantLoad(_Strict):
    name: str
    key: str = ""  # API key ("" for a server without tenants)
    weight: float = Field(1.0, gt=0)
    rate_rps: float | None = Field(None, gt=0)  # its own open-loop rate (a noisy tenant); else a share of the total


class AdapterMix(_Strict):
    names: list[str] = Field(min_length=1)  # "base" is the base model
    zipf_s: float | None = Field(None, ge=0)  # popularity 1/k^s in this order
    weights: dict[str, float] | None = None

    @model_validator(mode="after")
    def _one_rule(self) -> AdapterMix:
        if (self.zipf_s is None) == (self.weights is None):
            raise ValueError("give exactly one of zipf_s and weights")
        if self.weights is not None and set(self.weights) != set(self.names):
            raise ValueError("weights must name every adapter in names, and only those")
        return self


class Phase(_Strict):
    at_s: float = Field(ge=0)
    rate_rps: float | None = Field(None, gt=0)  # the total open-loop rate from here on
    burst: int | None = Field(None, ge=1)  # this many requests at once, at at_s
    shift: int | None = None  # rotate the popularity ranking by this many places (a hot-set shift)
    tenant: str | None = None  # rate_rps and burst for this tenant alone (one with its own rate_rps): a tenant's burst


class Range(_Strict):
    min: int = Field(ge=1)
    max: int = Field(ge=1)

    @model_validator(mode="after")
    def _ordered(self) -> Range:
        if self.max < self.min:
            raise ValueError("max must be >= min")
        return self


class Prompts(_Strict):
    kind: Literal["random", "shared_prefix", "chat", "rag", "alora_pipeline"]
    length: Range = Range(min=32, max=128)  # the request's own (unshared) tokens
    num_prefixes: int = Field(4, ge=1)  # shared_prefix: system prompts; rag: documents
    prefix_tokens: int = Field(256, ge=1)
    sharing: float = Field(0.8, ge=0, le=1)  # shared_prefix: share of requests that use one
    turns: Range = Range(min=2, max=6)  # chat: turns per conversation
    alora_adapter: str | None = None  # alora_pipeline: the aLoRA to call after the base


class Load(_Strict):
    mode: Literal["open", "closed"] = "open"
    arrivals: Literal["poisson", "uniform"] = "poisson"
    rate_rps: float = Field(2.0, gt=0)  # open loop, before any phase changes it
    users: int = Field(4, ge=1)  # closed loop
    max_in_flight: int = Field(64, ge=1)


class SLO(_Strict):
    ttft_s: float = Field(2.0, gt=0)
    e2e_s: float = Field(30.0, gt=0)


class Scenario(_Strict):
    name: str
    seed: int = 0
    duration_s: float = Field(60.0, gt=0)
    warmup_s: float = Field(0.0, ge=0)  # requests sent before this are run but left out of the report's figures
    max_requests: int = Field(1000, ge=1)
    load: Load = Load()
    phases: list[Phase] = Field(default_factory=list)
    tenants: list[TenantLoad] = Field(min_length=1)
    adapters: AdapterMix
    prompts: Prompts
    output_tokens: Range = Range(min=8, max=32)
    slo: SLO = SLO()
    chunk_tokens: int = Field(PrefixCacheConfig.chunk_tokens, ge=1)  # the server's cache chunk, for the ideal hit share
    vocab_size: int = Field(4096, ge=16)  # token ids are drawn below this

    @model_validator(mode="after")
    def _consistent(self) -> Scenario:
        if self.prompts.kind == "alora_pipeline" and not self.prompts.alora_adapter:
            raise ValueError("prompts.alora_adapter is needed for alora_pipeline")
        if [p.at_s for p in self.phases] != sorted(p.at_s for p in self.phases):
            raise ValueError("phases must be in order of at_s")
        own = {t.name for t in self.tenants if t.rate_rps is not None}
        for i, phase in enumerate(self.phases):
            if phase.tenant is not None and phase.tenant not in own:
                raise ValueError(f"phases[{i}].tenant: {phase.tenant!r} is not a tenant with its own rate_rps "
                                 f"(a tenant's phase changes its own rate; known: {', '.join(sorted(own)) or 'none'})")
            if phase.tenant is not None and phase.shift is not None:
                raise ValueError(f"phases[{i}]: a shift changes every tenant's adapters: it takes no tenant")
        return self


def parse_scenario(data: object, source: str = "scenario") -> Scenario:
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: expected a mapping at the top level")
    try:
        return Scenario.model_validate(data)
    except ValidationError as e:
        raise ConfigError(f"{source}: {describe_errors(e)}") from e


def load_scenario(path: str | Path) -> Scenario:
    return parse_scenario(read_yaml(Path(path), "scenario"), str(path))
