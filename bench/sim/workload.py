"""A fleet scenario: the load tester's scenario (gateway/loadtest/scenario.py, parsed by its
own parser) with a `sim:` section for what only a fleet needs (thousands of adapters by
count, placement capacity, tenants' rate limits, the latency SLO per token), and its
requests, drawn from the seed with the load tester's own arrival process and samplers.

Prompts are not token ids here: a request is its shared prefix (which one, how long) and
its own tokens' count, so an hour of hundreds of requests a second fits in memory. Prefix
kinds as the load tester's: random, shared_prefix and rag (a shared prefix), chat (a turn's
prompt is its conversation's last prompt, the reply and a new message: the last prompt is its
cached prefix), alora_pipeline (a base call, then once it has ended an aLoRA call on its prompt
plus an invocation, whose tokens before the invocation are the base's KV).
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from gateway.config import ConfigError, describe_errors, read_yaml
from gateway.loadtest.generators import WeightedSampler, arrival_times
from gateway.loadtest.scenario import Range, Scenario, parse_scenario
from gateway.policy.autoscale import AutoscalingSettings

SIM_KINDS = ("random", "shared_prefix", "rag", "chat", "alora_pipeline")
ALORA_INVOCATION_TOKENS = 8  # an aLoRA call's invocation sequence (the load tester takes the server's)
BASE = "base"


class TenantLimit(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    requests_per_min: int | None = Field(None, ge=1)
    tokens_per_min: int | None = Field(None, ge=1)


class Fault(BaseModel):
    """A fault at `at_s`: `replica_lost` takes `replicas` replicas down (spread over the fleet) for `for_s`,
    after which they come back empty; `redis_down` makes the shared prefix tier miss for `for_s`;
    `redis_slow` adds `latency_s` to each lookup in it (a profile with the tier's costs, l2_fetch_token_s)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    at_s: float = Field(ge=0)
    kind: Literal["replica_lost", "redis_down", "redis_slow"]
    replicas: int = Field(1, ge=1)
    for_s: float = Field(30.0, gt=0)
    latency_s: float = Field(0.05, ge=0)  # redis_slow


class Churn(BaseModel):
    """Adapters that move while the fleet runs, through the registry's own placement functions:
    `replan_interval_s`, the registry's re-plan (gateway.policy.placement.rebalance over the
    requests routed since, halved after each); `new_versions_per_min`, adapters replaced by a new
    version (on the old one's shards, as the registry does, or by place_new; served once its
    replicas have loaded it, the old one then unregistered), picked by popularity."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    replan_interval_s: float | None = Field(None, gt=0)
    new_versions_per_min: float = Field(0.0, ge=0)
    # the registry's max_adapters_per_worker for what it places while running (default: sim.max_adapters_per_replica;
    # a placement planned up to that limit leaves no room for an adapter registered later)
    max_adapters_per_replica: int | None = Field(None, ge=1)


class SimScaling(BaseModel):
    """`loraplex simulate --autoscale`: each of `shards` shards (placement's plan for that many replicas;
    default the fewest that hold every adapter `redundancy` times) scaled by a policy every `tick_s`,
    within `policy`'s bounds, with `policy` the settings of ours (a config's `autoscaling` section)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    shards: int | None = Field(None, ge=1)
    initial_replicas: int = Field(1, ge=1)  # each shard's at the start (at least what the plan gave it, within the bounds)
    tick_s: float = Field(0.5, gt=0)
    policy: AutoscalingSettings = AutoscalingSettings(max_replicas=8)


class Users(BaseModel):
    """Closed-loop users (bench/sim/users.py): each sends a request, waits for its end (answered, refused
    or failed), pauses the profile's `hop_s` plus `think_s` and sends the next, from `from_s` until
    `until_s` (default: the run's end). Their prompts are their own tokens (no shared prefix); lengths
    default to the scenario's."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    num_users: int = Field(1, ge=1)
    tenant: str | None = None  # default: the scenario's first
    adapter: str = BASE
    from_s: float = Field(0.0, ge=0)
    until_s: float | None = Field(None, gt=0)
    think_s: float = Field(0.0, ge=0)
    prompt_tokens: Range | None = None  # default: prompts.length
    output_tokens: Range | None = None  # default: output_tokens


class SimSection(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    num_adapters: int | None = Field(None, ge=1)  # adapters a0000...: replace adapters.names (zipf_s applies)
    max_adapters_per_replica: int = Field(64, ge=1)  # placement capacity (gateway.policy.placement.plan)
    redundancy: int = Field(2, ge=1)
    shared_cache: bool = True  # a Redis tier: a prefix chunk computed anywhere is a hit everywhere
    itl_s: float = Field(0.2, gt=0)  # SLO: mean time between a request's tokens
    tenant_limits: dict[str, TenantLimit] = Field(default_factory=dict)
    profile: str | None = None  # bench/sim/profiles/NAME.yaml or a path
    faults: list[Fault] = Field(default_factory=list)
    stream_share: float = Field(0.5, ge=0, le=1)  # requests streamed: a lost replica's started streams fail, the rest retry
    churn: Churn = Churn()
    # how the adapters were first placed: `plan`, by the scenario's popularity (loraplex plan); `registry`, as adapters
    # registered while running are, their traffic unknown: `redundancy` copies each, spread evenly
    placed_by: Literal["plan", "registry"] = "plan"
    autoscaling: SimScaling = SimScaling()
    # closed-loop users beside the open-loop arrivals; a scenario of `load: {mode: closed}` has only these (none
    # given: `load.users` users from start to end, as the load tester runs it)
    users: list[Users] = Field(default_factory=list)


@dataclass(frozen=True)
class FleetScenario:
    scenario: Scenario
    sim: SimSection


def adapter_names(num: int) -> list[str]:
    width = len(str(num - 1))
    return [f"a{i:0{width}d}" for i in range(num)]


def parse_fleet_scenario(data: object, source: str = "scenario") -> FleetScenario:
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: expected a mapping at the top level")
    data = dict(data)
    try:
        sim = SimSection.model_validate(data.pop("sim", {}) or {})
    except ValidationError as e:
        raise ConfigError(f"{source}: sim: {describe_errors(e)}") from e
    if sim.num_adapters is not None:
        data["adapters"] = {**data.get("adapters", {}), "names": adapter_names(sim.num_adapters)}
    scenario = parse_scenario(data, source)
    if scenario.prompts.kind not in SIM_KINDS:
        raise ConfigError(f"{source}: the simulator takes prompts of kind {', '.join(SIM_KINDS)}, "
                          f"not {scenario.prompts.kind!r}")
    tenants = {t.name for t in scenario.tenants}
    unknown = sorted(set(sim.tenant_limits) - tenants)
    if unknown:
        raise ConfigError(f"{source}: sim.tenant_limits names unknown tenants: {', '.join(unknown)}")
    unknown = sorted({u.tenant for u in sim.users if u.tenant is not None} - tenants)
    if unknown:
        raise ConfigError(f"{source}: sim.users names unknown tenants: {', '.join(unknown)}")
    if scenario.load.mode == "closed" and not sim.users:
        sim = sim.model_copy(update={"users": [Users(num_users=scenario.load.users)]})
    return FleetScenario(scenario, sim)


def load_fleet_scenario(path: str | Path) -> FleetScenario:
    return parse_fleet_scenario(read_yaml(Path(path), "scenario"), str(path))


@dataclass(frozen=True)
class SimRequest:
    index: int
    at_s: float
    tenant: str
    adapter: str  # BASE for the base model
    prefix: int  # which shared prefix (-1: none)
    num_prefix_tokens: int
    num_own_tokens: int  # after the prefix, never shared
    max_tokens: int
    stores_tokens: int = -1  # its prompt's tokens it leaves in the cache under `prefix` (-1: num_prefix_tokens)
    kv_adapter: str = ""  # whose KV its prefix is ("": `adapter`'s; an aLoRA's before its activation: the base's)
    after: int = -1  # sent once this request (by index) has ended: an aLoRA pipeline's second call

    @property
    def num_prompt_tokens(self) -> int:
        return self.num_prefix_tokens + self.num_own_tokens

    @property
    def cache_key(self) -> tuple[str, str, int]:
        return self.tenant, self.kv_adapter or self.adapter, self.prefix

    @property
    def num_stored_tokens(self) -> int:
        return self.num_prefix_tokens if self.stores_tokens < 0 else self.stores_tokens


def scaled(scenario: Scenario, rate_rps: float | None = None, duration_s: float | None = None,
           seed: int | None = None) -> Scenario:
    """The scenario with its total rate set to `rate_rps` (every rate and burst scaled alike),
    another duration or seed."""
    update: dict[str, object] = {}
    if rate_rps is not None:
        x = rate_rps / scenario.load.rate_rps
        update["load"] = scenario.load.model_copy(update={"rate_rps": rate_rps})
        update["phases"] = [p.model_copy(update={"rate_rps": p.rate_rps and p.rate_rps * x,
                                                 "burst": p.burst and max(1, round(p.burst * x))}) for p in scenario.phases]
        update["tenants"] = [t.model_copy(update={"rate_rps": t.rate_rps and t.rate_rps * x}) for t in scenario.tenants]
    if duration_s is not None:
        update["duration_s"] = duration_s
    if seed is not None:
        update["seed"] = seed
    return scenario.model_copy(update=update)


@dataclass(slots=True)
class _Conversation:
    adapter: str
    prefix: int  # its cache key: its first request's index
    num_tokens: int  # its last prompt's
    turns_left: int


def requests(scenario: Scenario) -> Iterator[SimRequest]:
    """Every request of the open-loop run in arrival order (the load tester's plan_workload,
    with prompts as prefix + own token counts), at most `max_requests`; none in a closed-loop
    scenario (its users send theirs as their requests end: bench/sim/users.py)."""
    if scenario.load.mode != "open":
        return
    rng = random.Random(scenario.seed)
    mix = scenario.adapters
    adapters = (WeightedSampler.zipf(mix.names, mix.zipf_s) if mix.zipf_s is not None
                else WeightedSampler(mix.names, [mix.weights[n] for n in mix.names]))
    shared = [t for t in scenario.tenants if t.rate_rps is None]
    tenants = WeightedSampler([t.name for t in shared], [t.weight for t in shared]) if shared else None
    events: list[tuple[float, str | None]] = [(t, None) for t in arrival_times(scenario, rng)] if tenants else []
    for own in (t for t in scenario.tenants if t.rate_rps is not None):
        events += [(t, own.name) for t in arrival_times(scenario, rng, own.rate_rps, tenant=own.name)]
    events.sort(key=lambda e: e[0])
    shifts = sorted((p.at_s, p.shift) for p in scenario.phases if p.shift)
    p = scenario.prompts
    prefix_pick = WeightedSampler.zipf([str(i) for i in range(p.num_prefixes)], 1.0)
    conversations: dict[str, list[_Conversation]] = {}  # chat: per tenant, the live ones
    index = 0
    for at, fixed_tenant in events:
        if index >= scenario.max_requests:
            break
        while shifts and shifts[0][0] <= at:
            adapters.rotate(shifts.pop(0)[1])
        tenant = fixed_tenant or tenants.sample(rng)
        adapter = adapters.sample(rng)
        num_own = rng.randint(p.length.min, p.length.max)
        max_tokens = rng.randint(scenario.output_tokens.min, scenario.output_tokens.max)
        if p.kind == "chat":  # as the load tester: 70% continue a live conversation of the tenant's
            live = conversations.setdefault(tenant, [])
            if live and rng.random() < 0.7:
                conv = rng.choice(live)
                last = conv.num_tokens
                conv.num_tokens += scenario.output_tokens.max + num_own  # the reply, then the next turn
                conv.turns_left -= 1
                if not conv.turns_left:
                    live.remove(conv)
                yield SimRequest(index, at, tenant, conv.adapter, conv.prefix, last, conv.num_tokens - last, max_tokens,
                                 conv.num_tokens)
            else:
                turns_left = rng.randint(p.turns.min, p.turns.max) - 1
                if turns_left:
                    live.append(_Conversation(adapter, index, num_own, turns_left))
                yield SimRequest(index, at, tenant, adapter, index, 0, num_own, max_tokens, num_own)
            index += 1
            continue
        if p.kind == "alora_pipeline":  # the base call, then the aLoRA's on the same prompt (its KV: the base's)
            yield SimRequest(index, at, tenant, BASE, index, 0, num_own, max_tokens, num_own)
            if index + 1 < scenario.max_requests:
                yield SimRequest(index + 1, at, tenant, p.alora_adapter or "alora", index, num_own, ALORA_INVOCATION_TOKENS,
                                 max_tokens, 0, BASE, after=index)
            index += 2
            continue
        prefix = -1
        if p.kind == "rag" or (p.kind == "shared_prefix" and rng.random() < p.sharing):
            prefix = int(prefix_pick.sample(rng))
        yield SimRequest(index, at, tenant, adapter, prefix, p.prefix_tokens if prefix >= 0 else 0, num_own, max_tokens)
        index += 1
