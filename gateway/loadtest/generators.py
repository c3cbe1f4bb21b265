"""The workload of a scenario, decided up front from its seed (deterministic): when each
request arrives, from which tenant, for which adapter, with which prompt tokens; and
the scenario's ideal cache-hit share (prompt tokens in whole chunks seen before)."""

from __future__ import annotations

import bisect
import hashlib
import random
from collections.abc import Sequence
from dataclasses import dataclass, field

from gateway.loadtest.scenario import Scenario

FIRST_TOKEN_ID = 100  # below: special tokens in most vocabularies


class WeightedSampler:
    """Draws names by weight; `rotate(k)` shifts which name holds which weight (a hot-set shift)."""

    def __init__(self, names: Sequence[str], weights: Sequence[float]) -> None:
        if not names or len(names) != len(weights) or sum(weights) <= 0:
            raise ValueError("need names and as many non-negative weights, not all zero")
        self.names, self.weights = list(names), list(weights)
        self.offset = 0
        total, running = sum(weights), 0.0
        self._cumulative = []
        for w in weights:
            running += w / total
            self._cumulative.append(running)

    @classmethod
    def zipf(cls, names: Sequence[str], s: float) -> WeightedSampler:
        return cls(names, [1.0 / (k + 1) ** s for k in range(len(names))])

    def rotate(self, places: int) -> None:
        self.offset = (self.offset + places) % len(self.names)

    def probability(self, name: str) -> float:
        rank = (self.names.index(name) - self.offset) % len(self.names)
        return self.weights[rank] / sum(self.weights)

    def sample(self, rng: random.Random) -> str:
        rank = min(bisect.bisect_left(self._cumulative, rng.random()), len(self.names) - 1)
        return self.names[(rank + self.offset) % len(self.names)]


@dataclass
class PlannedRequest:
    at_s: float
    tenant: str
    adapter: str  # "base" for the base model
    prompt_ids: list[int]
    max_tokens: int
    kind: str = "request"  # request | alora (the second call of a pipeline)
    alora_activation: int | None = None  # where the aLoRA turns on (nothing from here on is cached)
    after: int | None = None  # index of the request this one waits for (an aLoRA call waits for its base call)
    ideal_cached: int = 0


@dataclass
class _Conversation:
    tenant: str
    adapter: str
    tokens: list[int]
    turns_left: int


@dataclass
class Workload:
    requests: list[PlannedRequest] = field(default_factory=list)


def _tokens(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(FIRST_TOKEN_ID, vocab) for _ in range(n)]


def arrival_times(scenario: Scenario, rng: random.Random, rate_rps: float | None = None, phases: bool = True,
                  tenant: str | None = None) -> list[float]:
    """Open-loop arrival times in [0, duration): Poisson (or evenly spaced) at the rate the
    phases set, plus each phase's burst. `rate_rps`: the stream of `tenant`, a tenant with a rate
    of its own (the phases for that tenant set it; every tenant's bursts add to it too)."""
    duration, rate = scenario.duration_s, rate_rps or scenario.load.rate_rps
    mine = [p for p in scenario.phases if phases and (p.tenant is None or p.tenant == tenant)]
    if rate_rps is None:
        mine = [p for p in mine if p.tenant is None]
    changes = [(p.at_s, p.rate_rps) for p in mine if p.rate_rps and (rate_rps is None or p.tenant is not None)]
    bursts = [(p.at_s, p.burst) for p in mine if p.burst]
    times, t = [], 0.0
    while True:
        for at, new_rate in changes:
            if at <= t:
                rate = new_rate
        gap = rng.expovariate(rate) if scenario.load.arrivals == "poisson" else 1.0 / rate
        next_change = min((at for at, _ in changes if at > t), default=None)
        if next_change is not None and t + gap > next_change:
            t = next_change  # memoryless: start afresh at the new rate
            continue
        t += gap
        if t >= duration:
            break
        times.append(t)
    for at, size in bursts:
        times += [at] * size
    return sorted(times)


def plan_workload(scenario: Scenario, invocation_tokens: Sequence[int] = ()) -> Workload:
    """Every request of an open-loop run (closed loop: the same list, sent in order)."""
    rng = random.Random(scenario.seed)
    mix = scenario.adapters
    adapters = (
        WeightedSampler.zipf(mix.names, mix.zipf_s)
        if mix.zipf_s is not None
        else WeightedSampler(mix.names, [mix.weights[n] for n in mix.names])
    )
    shared = [t for t in scenario.tenants if t.rate_rps is None]
    tenants = WeightedSampler([t.name for t in shared], [t.weight for t in shared]) if shared else None
    events = _arrivals(scenario, rng, tenants is not None)
    shifts = sorted((p.at_s, p.shift) for p in scenario.phases if p.shift)
    planner = _Planner(scenario, rng, invocation_tokens)
    out = planner.requests
    for at, fixed_tenant in events:
        if len(out) >= scenario.max_requests:
            break
        while shifts and shifts[0][0] <= at:
            adapters.rotate(shifts.pop(0)[1])
        tenant = fixed_tenant or tenants.sample(rng)
        planner.add(at, tenant, adapters.sample(rng))
    out = out[: scenario.max_requests]
    if out and out[-1].after is not None and out[-1].after >= len(out):
        out.pop()
    mark_ideal_cache(out, scenario.chunk_tokens)
    return Workload(out)


def _arrivals(scenario: Scenario, rng: random.Random, has_shared_tenants: bool) -> list[tuple[float, str | None]]:
    """Each arrival's time and, for a tenant with a rate of its own, its name (None: one of the
    tenants that share the scenario's rate, drawn by weight), in order of time."""
    events: list[tuple[float, str | None]] = [(t, None) for t in arrival_times(scenario, rng)] if has_shared_tenants else []
    for own in (t for t in scenario.tenants if t.rate_rps is not None):  # tenants with their own rate (noisy ones)
        events += [(t, own.name) for t in arrival_times(scenario, rng, own.rate_rps, tenant=own.name)]
    if scenario.load.mode == "closed":  # arrival times do not matter; enough requests for the run
        events = [(0.0, None) for _ in range(scenario.max_requests)] if has_shared_tenants else events
    events.sort(key=lambda e: e[0])
    return events


class _Planner:
    """The requests of a run, one arrival at a time, each with its prompt as the scenario's kind
    makes it (the run's `rng` draws, in arrival order, so a seed makes one workload)."""

    def __init__(self, scenario: Scenario, rng: random.Random, invocation_tokens: Sequence[int]) -> None:
        self.scenario, self.rng, self.invocation_tokens = scenario, rng, invocation_tokens
        p, vocab = scenario.prompts, scenario.vocab_size
        self.prefixes = [_tokens(random.Random(f"{scenario.seed}-prefix-{i}"), p.prefix_tokens, vocab) for i in range(p.num_prefixes)]
        self.prefix_pick = WeightedSampler.zipf([str(i) for i in range(p.num_prefixes)], 1.0)
        self.conversations: list[_Conversation] = []
        self.requests: list[PlannedRequest] = []

    def add(self, at: float, tenant: str, adapter: str) -> None:
        rng, p, scenario = self.rng, self.scenario.prompts, self.scenario
        own = _tokens(rng, rng.randint(p.length.min, p.length.max), scenario.vocab_size)
        max_tokens = rng.randint(scenario.output_tokens.min, scenario.output_tokens.max)
        if p.kind == "random":
            prompt = own
        elif p.kind in ("shared_prefix", "rag"):
            use = p.kind == "rag" or rng.random() < p.sharing
            prompt = (self.prefixes[int(self.prefix_pick.sample(rng))] if use else []) + own
        elif p.kind == "chat":
            adapter, prompt = self._chat_turn(tenant, adapter, own)
        else:  # alora_pipeline: a base call, then the aLoRA on the same prompt plus its invocation
            self.requests.append(PlannedRequest(at, tenant, "base", own, max_tokens))
            activation = max(len(own) - 1, 0)
            self.requests.append(PlannedRequest(at, tenant, p.alora_adapter, own + list(self.invocation_tokens), max_tokens,
                                                "alora", activation, after=len(self.requests) - 1))
            return
        self.requests.append(PlannedRequest(at, tenant, adapter, prompt, max_tokens))

    def _chat_turn(self, tenant: str, adapter: str, own: list[int]) -> tuple[str, list[int]]:
        """The next turn of one of the tenant's live conversations (its adapter stays), or a new one's first."""
        rng, scenario = self.rng, self.scenario
        live = [c for c in self.conversations if c.tenant == tenant and c.turns_left > 0]
        if live and rng.random() < 0.7:
            conv = rng.choice(live)
            conv.tokens += _tokens(rng, scenario.output_tokens.max, scenario.vocab_size) + own  # the reply, then the next user turn
            conv.turns_left -= 1
        else:
            conv = _Conversation(tenant, adapter, own, rng.randint(scenario.prompts.turns.min, scenario.prompts.turns.max) - 1)
            self.conversations.append(conv)
        return conv.adapter, list(conv.tokens)


def mark_ideal_cache(requests: Sequence[PlannedRequest], chunk_tokens: int) -> None:
    """Each request's prompt tokens in leading whole chunks some earlier request had, under the
    same tenant and KV adapter set (an aLoRA's chunks before activation are the base's)."""
    seen: set[bytes] = set()
    for r in requests:
        kv_set = "base" if r.kind == "alora" else r.adapter
        limit = len(r.prompt_ids) - 1 if r.alora_activation is None else min(len(r.prompt_ids) - 1, r.alora_activation)
        key = hashlib.blake2b(f"{r.tenant}\0{kv_set}".encode(), digest_size=16).digest()
        hit, run = 0, True
        for start in range(0, limit - limit % chunk_tokens, chunk_tokens):
            key = hashlib.blake2b(key + repr(r.prompt_ids[start : start + chunk_tokens]).encode(), digest_size=16).digest()
            if run and key in seen:
                hit += chunk_tokens
            else:
                run = False
            seen.add(key)
        r.ideal_cached = hit
