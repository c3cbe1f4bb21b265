"""An oracle: a policy told the scenario's rate: how few replica-seconds shards of whole replicas can use
(docs/benchmarks.md#autoscaling). No policy can know the rate ahead; this one does, so the distance
from it to a policy is what the policy's guessing costs, and from it to a fixed fleet what scaling
per shard can save at all.

Each shard has ceil(rate / num_shards / capacity_rps) replicas (within the shard's bounds, at least
one), where rate is the larger of the rate now and the rate `lead_s` later: a replica is asked for a
start ahead of the demand it serves, and let go once that demand has gone. The shards are taken to
share the traffic evenly, as placement's plan spreads it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from bench.sim.autoscalers import ShardSample
from bench.sim.elastic import run_scaled, scaled_placement
from bench.sim.profile import CostProfile
from bench.sim.report import SLO
from bench.sim.scaling import Scaler
from bench.sim.workload import FleetScenario
from gateway.loadtest.scenario import Scenario
from gateway.policy.autoscale import AutoscalingSettings


def rate_at(scenario: Scenario) -> Callable[[float], float]:
    """The scenario's open-loop arrival rate (requests a second) at a time: the shared rate and every
    tenant's own, as its phases set them (a phase's burst of requests at once is not a rate)."""
    own = {t.name: t.rate_rps for t in scenario.tenants if t.rate_rps is not None}

    def rate(at_s: float) -> float:
        shared, rates = scenario.load.rate_rps, dict(own)
        for phase in scenario.phases:
            if phase.at_s <= at_s and phase.rate_rps is not None:
                if phase.tenant is None:
                    shared = phase.rate_rps
                else:
                    rates[phase.tenant] = phase.rate_rps
        return shared + sum(rates.values())

    return rate


class Oracle:
    name = "oracle"

    def __init__(self, settings: AutoscalingSettings, rate: Callable[[float], float], num_shards: int,
                 capacity_rps: float, lead_s: float) -> None:
        if capacity_rps <= 0 or num_shards < 1 or lead_s < 0:
            raise ValueError(f"capacity_rps must be > 0, num_shards >= 1 and lead_s >= 0, got {capacity_rps}, "
                             f"{num_shards} and {lead_s}")
        self.settings, self.rate, self.num_shards = settings, rate, num_shards
        self.capacity_rps, self.lead_s = capacity_rps, lead_s

    def decide(self, sample: ShardSample, now_s: float) -> int:
        rate = max(self.rate(now_s), self.rate(now_s + self.lead_s))
        wanted = math.ceil(rate / self.num_shards / self.capacity_rps - 1e-9)
        return min(max(wanted, self.settings.min_replicas, 1), self.settings.max_replicas)


def run_oracle(fleet: FleetScenario, capacity_rps: float, profile: CostProfile, slo: SLO) -> tuple[dict[str, Any], Scaler]:
    """One run with every shard scaled by a Oracle of `capacity_rps` a replica, asking a replica's
    longest start (the profile's, its pins fetched) ahead: its row, and the Scaler."""
    placement, shards, _ = scaled_placement(fleet)
    most_pins = max(len(held) for held in placement.pins)
    lead_s = profile.replica_start_s + most_pins * profile.adapter_fetch_s + fleet.sim.autoscaling.tick_s
    rate = rate_at(fleet.scenario)

    def build(settings: AutoscalingSettings) -> Oracle:
        return Oracle(settings, rate, len(shards), capacity_rps, lead_s)

    return run_scaled(fleet, build, profile, slo, name=f"oracle ({capacity_rps:g} req/s a replica)")
