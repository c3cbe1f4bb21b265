"""bench/autoscale_burst.py's run in the simulator, and the two side by side.

The scenario (bench/sim/scenarios/autoscale-burst.yaml) mirrors the real run's defaults: one shard
of the base model scaled by ours (gateway.policy.autoscale.decide) within its `autoscaling`, one
light user throughout (a request, a pause, the next), and a burst of closed-loop users from
`from_s` for its duration (`sim.users`: the group with the most users is the burst). `mirrored`
sets it to another run's flags. The figures of a run, real or simulated, are a `BurstFigures`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from bench.sim.elastic import run_scaled
from bench.sim.profile import CostProfile, load_profile
from bench.sim.report import SLO, percentile
from bench.sim.workload import FleetScenario, load_fleet_scenario
from gateway.loadtest.scenario import Range
from gateway.policy.autoscale import AutoscalingSettings

SCENARIO = Path(__file__).parent / "scenarios" / "autoscale-burst.yaml"


@dataclass(frozen=True)
class BurstFigures:
    starting_s: tuple[float | None, ...]  # each replica beyond min_replicas: asked for, s from the burst's start
    answered_s: tuple[float | None, ...]  # ... its first answer to a client
    back_s: float | None  # from the burst's end (its last request's end) to the shard at min_replicas again
    peak: int  # replicas up at most, from the burst's start
    num_requests: int  # the burst's and the light load's
    num_failed: int  # of those, not answered (refused or failed)
    replica_s: float  # replicas starting, up or draining, summed from the burst's start to back at min_replicas
    ttft_p50_s: float  # requests sent in the burst


@dataclass(frozen=True)
class BurstShape:
    """The real run's load: the burst's users, length and output tokens, the light user's pause between its
    requests, how long it runs alone before the burst and on after the shard is back at min_replicas."""

    burst_users: int
    burst_s: float
    burst_tokens: int
    light_gap_s: float
    light_before_s: float
    light_after_s: float = 10.0  # the light load once back at min_replicas (the real run stops counting then)


def replica_seconds(timeline: Sequence[tuple[float, int]], from_s: float, to_s: float) -> float:
    """The replicas counted over [from_s, to_s], each reading's count held until the next reading."""
    total = 0.0
    for (at_s, count), (next_s, _) in zip(timeline, [*timeline[1:], (to_s, 0)]):
        total += count * max(0.0, min(next_s, to_s) - max(at_s, from_s))
    return total


def burst_group(fleet: FleetScenario) -> int:
    users = fleet.sim.users
    return max(range(len(users)), key=lambda g: users[g].num_users)


def mirrored(fleet: FleetScenario, settings: AutoscalingSettings, shape: BurstShape) -> FleetScenario:
    """The scenario with the real run's shard autoscaling and load."""
    g = burst_group(fleet)
    users = [u.model_copy(update={"think_s": shape.light_gap_s}) for u in fleet.sim.users]
    from_s = shape.light_before_s
    users[g] = users[g].model_copy(update={"num_users": shape.burst_users, "from_s": from_s, "think_s": 0.0,
                                           "until_s": from_s + shape.burst_s,
                                           "output_tokens": Range(min=shape.burst_tokens, max=shape.burst_tokens)})
    scaling = fleet.sim.autoscaling.model_copy(update={"policy": settings})
    until_s = fleet.sim.users[g].until_s or fleet.scenario.duration_s
    duration_s = from_s + shape.burst_s + fleet.scenario.duration_s - until_s  # as long after the burst, for the way down
    return FleetScenario(fleet.scenario.model_copy(update={"duration_s": duration_s}),
                         fleet.sim.model_copy(update={"users": users, "autoscaling": scaling}))


def _walk(events: Sequence[tuple[float, int, str]], low: int, burst_s: float, end_s: float) -> tuple[int, float | None]:
    """(replicas up at most from `burst_s`, the first time from `end_s` on that only `low` replicas are on: starting,
    up or draining)."""
    up, on, peak, back = set(range(low)), set(range(low)), low, None
    for at_s, i, what in sorted(events):
        if back is None and at_s > end_s and len(on) <= low:
            back = end_s  # at min_replicas already when the burst ended
        if what in ("starting", "up"):
            on.add(i)
        if what == "up":
            up.add(i)
        elif what in ("draining", "off"):
            up.discard(i)
        if what == "off":
            on.discard(i)
        if at_s >= burst_s:
            peak = max(peak, len(up))
        if back is None and at_s >= end_s and len(on) <= low:
            back = at_s
    if back is None and len(on) <= low:  # nothing changed after the burst's end
        back = end_s
    return peak, back


def simulated(fleet: FleetScenario, profile: CostProfile, light_after_s: float = 10.0) -> BurstFigures:
    """The scenario run once with ours, read as the real run is: its requests until `light_after_s` after the
    shard is back at min_replicas, the burst's TTFT over the burst group's (its tenant's) requests."""
    _, scaler = run_scaled(fleet, "ours", profile, SLO(fleet.scenario.slo.ttft_s, fleet.sim.itl_s))
    run, figures = scaler.fleet, scaler.figures
    g, low = burst_group(fleet), fleet.sim.autoscaling.policy.min_replicas
    start_s = fleet.sim.users[g].from_s
    end_s = run.users.last_end_s[g] or start_s
    events = sorted(figures.events)
    peak, back = _walk(events, low, start_s, end_s)

    def first(i: int, what: str) -> float | None:
        return next((at_s - start_s for at_s, j, w in events if j == i and w == what and at_s >= start_s), None)

    extra = range(low, fleet.sim.autoscaling.policy.max_replicas)
    outcomes, record = run.record.outcomes, run.record
    burst_tenant = fleet.sim.users[g].tenant or fleet.scenario.tenants[0].name
    ttfts = [t for t, at_s, tenant in zip(record.ttft_s, record.arrivals, record.tenants)
             if start_s <= at_s < end_s and tenant == burst_tenant]
    until_s = (end_s if back is None else back) + light_after_s
    num_failed = sum(outcomes.values()) - outcomes["completed"]
    return BurstFigures(tuple(first(i, "starting") for i in extra), tuple(first(i, "answered") for i in extra),
                        None if back is None else back - end_s, peak, sum(at_s < until_s for at_s in record.arrivals) + num_failed,
                        num_failed,
                        replica_seconds(figures.timeline, start_s, end_s if back is None else back),
                        percentile(ttfts, 0.5) if ttfts else float("nan"))


def beside(real: BurstFigures, profile_name: str, settings: AutoscalingSettings, num_seq_slots: int, shape: BurstShape,
           shard: str) -> str:
    """The real run's scenario simulated on a profile (its engine with the run's KV slots), beside the real figures."""
    profile = load_profile(profile_name)
    profile = replace(profile, engine=replace(profile.engine, num_seq_slots=num_seq_slots))
    sim = simulated(mirrored(load_fleet_scenario(SCENARIO), settings, shape), profile, shape.light_after_s)
    names = [f"{shard}-{i}" for i in range(settings.min_replicas, settings.max_replicas)]
    return (f"\nthe same run simulated (bench/sim/scenarios/{SCENARIO.name}, profile {profile.name}, replica_start_s "
            f"{profile.replica_start_s:g} s):\n{side_by_side(real, sim, names)}")


def _cell(value: float | int | None, digits: int) -> str:
    return "never" if value is None else f"{value:,.{digits}f}"


def side_by_side(real: BurstFigures, sim: BurstFigures, names: Sequence[str]) -> str:
    """A table of the two runs' figures; `names`: the replicas beyond min_replicas."""
    rows: list[tuple[str, float | int | None, float | int | None, int]] = []
    for i, name in enumerate(names):
        rows.append((f"{name} asked for (s from the burst's start)", real.starting_s[i], sim.starting_s[i], 1))
        rows.append((f"{name} first answer (s from the burst's start)", real.answered_s[i], sim.answered_s[i], 1))
    rows += [("back at min_replicas (s from the burst's end)", real.back_s, sim.back_s, 1),
             ("replicas up at most", real.peak, sim.peak, 0),
             ("requests failed", real.num_failed, sim.num_failed, 0),
             ("requests (burst and light load)", real.num_requests, sim.num_requests, 0),
             ("replica-seconds (burst's start to back at min)", real.replica_s, sim.replica_s, 0),
             ("burst TTFT p50 (ms)", 1e3 * real.ttft_p50_s, 1e3 * sim.ttft_p50_s, 0)]
    lines = [f"{'':50} {'real':>10} {'simulated':>10}"]
    lines += [f"{label:50} {_cell(r, d):>10} {_cell(s, d):>10}" for label, r, s, d in rows]
    return "\n".join(lines)
