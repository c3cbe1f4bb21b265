"""How many replicas a shard should have (docs/architecture.md#autoscaling): `decide`, a pure
function of what the shard's replicas report (`ShardLoad`), the shard's `AutoscalingSettings`,
the timers it keeps between calls (`ScalingState`) and the clock, passed in. Torch-free and
Ray-free: on Ray Serve, the shard's deployments' custom `AutoscalingPolicy` calls it once per tick
with a load built from their replicas' records (gateway/cluster/autoscaling.py: Serve's own delays
0 and factors 1 there, so the timers here are the only ones), and the fleet simulator
(bench/sim/scaling.py) calls it as it is.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace

# the demand's two moving averages forget half of themselves in this long: the fast one is what the shard asks for
# now, without a second's noise; the slow one what it asked for lately (their gap is the trend: noise averages out)
FAST_HALF_LIFE_S = 5.0
SLOW_HALF_LIFE_S = 30.0
_LAG_S = (SLOW_HALF_LIFE_S - FAST_HALF_LIFE_S) / math.log(2)  # how far the slow one trails the fast on a steady ramp
# a replica just ready drains the queue its start let grow: so long (the fast average forgets 7/8 of that queue), its
# queue and late first tokens ask for no more, as while it started
SETTLE_S = 3 * FAST_HALF_LIFE_S


TIMES = ("ttft_slo_s", "upscale_delay_s", "downscale_delay_s", "idle_s", "lead_s", "backlog_s")


@dataclass(frozen=True)
class AutoscalingSettings:
    """A shard's `autoscaling` section of the deployment config (every default here, once)."""

    min_replicas: int = 1  # 0: the shard may sleep (its first request then waits for a replica's start)
    max_replicas: int = 1
    # KV slots asked for (running + waiting requests) per KV slot the replicas have, aimed at when scaling
    target_utilization: float = 0.8
    ttft_slo_s: float = 1.0  # time to first token: a recent p90 above it asks for more replicas
    upscale_delay_s: float = 2.0  # demand above the target this long: every replica it asks for, at once
    # the way down reads the demand averaged over about this long (half-life: half of it); about a replica's start
    downscale_delay_s: float = 30.0
    downscale_margin: float = 0.0  # down to what that average fits at target_utilization - margin
    idle_s: float = 300.0  # with min_replicas 0: no request this long, and the last replica goes
    lead_s: float = 20.0  # how far ahead a growing demand is followed: about a new replica's start, fetches included
    backlog_s: float = 0.5  # queued prompt work (seconds of prefill) per replica beyond which it counts as full

    def __post_init__(self) -> None:
        for name in ("target_utilization", "downscale_margin", *TIMES):
            if not math.isfinite(getattr(self, name)):  # NaN never passes a comparison; an infinite lead makes NaN
                raise ValueError(f"{name} must be a finite number, got {getattr(self, name)}")
        if self.min_replicas < 0 or self.max_replicas < 1:
            raise ValueError(f"min_replicas must be >= 0 and max_replicas >= 1, got {self.min_replicas} and {self.max_replicas}")
        if self.min_replicas > self.max_replicas:
            raise ValueError(f"min_replicas ({self.min_replicas}) must be <= max_replicas ({self.max_replicas})")
        if not 0 < self.target_utilization <= 1:
            raise ValueError(f"target_utilization must be in (0, 1], got {self.target_utilization}")
        if not 0 <= self.downscale_margin < self.target_utilization:
            raise ValueError(f"downscale_margin must be in [0, target_utilization), got {self.downscale_margin}")
        if not self.ttft_slo_s > 0 or not self.backlog_s > 0:
            raise ValueError(f"ttft_slo_s and backlog_s must be > 0, got {self.ttft_slo_s} and {self.backlog_s}")
        if min(self.upscale_delay_s, self.downscale_delay_s, self.idle_s, self.lead_s) < 0:
            raise ValueError("upscale_delay_s, downscale_delay_s, idle_s and lead_s must be >= 0")

    @classmethod
    def fixed(cls, replicas: int) -> AutoscalingSettings:
        """A shard with a fixed number of replicas: what `decide` keeps it at."""
        return cls(min_replicas=replicas, max_replicas=replicas)


@dataclass(frozen=True)
class ShardLoad:
    """What a shard's replicas report, summed over those that serve (`num_ready`); a starting
    replica reports nothing yet, a draining one is no longer the shard's."""

    num_ready: int  # replicas that take requests
    num_starting: int  # asked for, not serving yet (model and adapters being fetched)
    num_slots: int  # KV slots of the ready replicas (each request holds one while it runs)
    num_running: int  # requests holding a KV slot
    num_waiting: int  # requests queued at the replicas for a slot
    backlog_s: float = 0.0  # queued prompt tokens' prefill time, per ready replica (their queued tokens / prefill rate)
    ttft_p50_s: float | None = None  # recent time to first token (None: no first token lately)
    ttft_p90_s: float | None = None
    num_queued: int = 0  # requests waiting for the shard to have a replica at all (it has none)

    @property
    def num_requests(self) -> int:
        return self.num_running + self.num_waiting + self.num_queued

    @property
    def slots_asked(self) -> int:
        """KV slots the requests ask for, a queue counting up to the slots there are: a queue is drained
        by the replicas it brings, so one longer than that asks for their start sooner, not for more of them."""
        return self.num_running + min(self.num_waiting, self.num_slots) + self.num_queued


@dataclass(frozen=True)
class ScalingState:
    """What `decide` remembers between calls: since when it has wanted more replicas (None: not now),
    the demand's moving averages (its trend, and the longer one the way down reads), when the shard
    was last busy and when its ready replicas last grew."""

    up_since_s: float | None = None
    busy_s: float | None = None  # the last call that saw a request
    demand: float | None = None  # KV slots asked for, averaged (FAST_HALF_LIFE_S)
    demand_slow: float | None = None  # the same over SLOW_HALF_LIFE_S
    seen_s: float | None = None  # the last call
    demand_down: float | None = None  # the same with half-life downscale_delay_s / 2: what the way down reads
    ready: int | None = None  # the ready replicas at the last call
    ready_s: float | None = None  # when their count last grew
    since_s: float | None = None  # the first call: the way down waits until its average has seen downscale_delay_s

    def as_dict(self) -> dict[str, float | None]:
        """Plain data (a Serve policy's `policy_state`)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, float | None]) -> ScalingState:
        return cls(**{k: data[k] for k in cls.__dataclass_fields__ if k in data})  # type: ignore[arg-type]


def with_replicas(shard: object, most_allowed: int) -> object:
    """A config's shard section (a mapping) with `autoscaling`: its `replicas` is the section's
    max_replicas (`replicas` alone gives it; both given must agree): the replicas it may have, each a
    Serve deployment of zero or one replica (gateway/cluster/autoscaling.py)."""
    scaling = shard.get("autoscaling") if isinstance(shard, dict) else None
    if not isinstance(shard, dict) or not isinstance(scaling, dict):
        return shard
    most = scaling.get("max_replicas", shard.get("replicas", 1))
    if "replicas" in shard and shard["replicas"] != most:
        raise ValueError(f"replicas ({shard['replicas']}) must equal autoscaling.max_replicas ({most}), or be left out")
    if isinstance(most, int) and most > most_allowed:
        raise ValueError(f"autoscaling.max_replicas must be <= {most_allowed}, got {most}")
    return {**shard, "autoscaling": {**scaling, "max_replicas": most}, "replicas": max(most, 1) if isinstance(most, int) else most}


def _count(value: float) -> int:
    """A count as reported: NaN or below 0 (a metric not there yet) is 0."""
    return int(value) if math.isfinite(value) and value > 0 else 0


def _sane(load: ShardLoad) -> ShardLoad:
    """The load with what no replica could report (NaN, negative) read as nothing, so it cannot make
    the decision fail or poison the averages it keeps."""

    def seconds(value: float | None) -> float | None:
        return value if value is not None and math.isfinite(value) and value >= 0 else None

    return ShardLoad(_count(load.num_ready), _count(load.num_starting), _count(load.num_slots), _count(load.num_running),
                     _count(load.num_waiting), seconds(load.backlog_s) or 0.0, seconds(load.ttft_p50_s),
                     seconds(load.ttft_p90_s), _count(load.num_queued))


def _averaged(state: ScalingState, demand: float, now_s: float, down_half_life_s: float, held: float) -> ScalingState:
    """The demand's moving averages, moved to `now_s`; the way down's starts from `held` (what the replicas
    there are hold at the target: a fresh state takes the count it finds for what the demand asked for)."""
    if state.demand is None or state.demand_slow is None or state.seen_s is None:
        return replace(state, demand=demand, demand_slow=demand, demand_down=max(demand, held), seen_s=now_s, since_s=now_s)
    dt = max(0.0, now_s - state.seen_s)
    fast, slow = 0.5 ** (dt / FAST_HALF_LIFE_S), 0.5 ** (dt / SLOW_HALF_LIFE_S)
    down = 0.5 ** (dt / down_half_life_s) if down_half_life_s > 0 else 0.0
    before = demand if state.demand_down is None else state.demand_down
    return replace(state, demand=fast * state.demand + (1 - fast) * demand,
                   demand_slow=slow * state.demand_slow + (1 - slow) * demand,
                   demand_down=down * before + (1 - down) * demand, seen_s=now_s)


def _settling(state: ScalingState, load: ShardLoad, now_s: float) -> tuple[bool, ScalingState]:
    """Whether a replica became ready less than SETTLE_S ago (its count grew), and the state that remembers it."""
    if state.ready is not None and load.num_ready > state.ready:
        state = replace(state, ready_s=now_s)
    state = replace(state, ready=load.num_ready)
    return state.ready_s is not None and now_s - state.ready_s < SETTLE_S, state


def wanted(load: ShardLoad, settings: AutoscalingSettings, state: ScalingState, settling: bool = False) -> tuple[int, int]:
    """(replicas the demand asks for now, replicas its longer average fits in at the lower target);
    `settling`: a replica just ready drains the queue, which asks for no more meanwhile."""
    slots_each = load.num_slots / load.num_ready if load.num_ready else 0
    if not slots_each:  # nothing serves (or reports slots yet): one replica per request asked for is too many, one
        # is enough to learn; while requests wait, the ones there stay
        return (1 if load.num_requests else 0), (load.num_ready if load.num_requests else 0)
    fast, slow = state.demand or 0.0, state.demand_slow or 0.0
    now = max(fast, load.slots_asked) if load.num_waiting and not settling else fast  # a queue is no noise: at once
    trend_per_s = max(0.0, fast - slow) / _LAG_S
    ahead = min(now + trend_per_s * settings.lead_s, 1.5 * now)  # a trend, not a queue's growth
    up = math.ceil(ahead / (slots_each * settings.target_utilization) - 1e-9)
    is_late = load.ttft_p90_s is not None and load.ttft_p90_s > settings.ttft_slo_s and load.num_waiting > 0
    if (is_late or load.backlog_s > settings.backlog_s) and not load.num_starting and not settling:  # the outcome, or its cause
        up = max(up, load.num_ready + 1)
    lower = settings.target_utilization - settings.downscale_margin
    average = state.demand_down or 0.0
    down = max(average, load.slots_asked) if load.num_waiting else average
    fits = math.ceil(down / (slots_each * lower) - 1e-9)
    return up, fits


def decide(load: ShardLoad, current: int, settings: AutoscalingSettings, state: ScalingState,
           now_s: float) -> tuple[int, ScalingState]:
    """The replicas the shard should have (`current`: those it has or is starting, not draining),
    and the state for the next call, at time `now_s`.

    What it reads, and why:
    - KV slots asked for (running + waiting requests, and any waiting for a replica) against the
      slots the ready replicas have: a replica's capacity is its KV slots, and beyond them a request
      waits, so demand is counted in slots, aimed at `target_utilization` of them (headroom for the
      demand's spread between two decisions and during a start); averaged over seconds, as requests
      come and go at random, but at once when requests queue;
    - its trend (a fast and a slow moving average apart): demand growing now is followed `lead_s`
      ahead, as a replica asked for now serves only after its start (model and adapters fetched);
    - queued prompt tokens, as seconds of prefill (`backlog_s`): long prompts queued cost more than
      their count says, and their wait is the next requests' time to first token;
    - TTFT p90 against the SLO: the outcome the demand model stands for; late first tokens while
      requests wait ask for one replica more than the model says;
    - requests waiting for a shard that has no replica: its only signal, acted on at once.

    Up fast: every replica asked for at once, after `upscale_delay_s` of asking (none from zero when
    a request waits); while replicas start, and for SETTLE_S after one became ready, more only if
    twice the count is asked for (the queue their start let grow would ask again for what is already
    coming, or has just come, and drains). Down from a longer average, as Knative's KPA does (its
    stable window, no band): the demand averaged with half-life `downscale_delay_s` / 2 (a fresh
    state's starting from what the replicas there are hold at the target), at once to what it fits
    at `target_utilization - downscale_margin`, at most half the replicas a decision (a demand that
    fell by half lets half go); a queue counts at once there too; never while a replica is starting
    (the count it is about to have is not measured yet), nor before the average has seen
    `downscale_delay_s` of demand; those let go drain what they hold (the caller's part); to zero
    only with `min_replicas` 0 after `idle_s` without a request.
    Never below min or above max: a count out of bounds is brought back at once."""
    load = _sane(load)
    held = load.num_slots * settings.target_utilization
    state = _averaged(state, float(load.slots_asked), now_s, settings.downscale_delay_s / 2, held)
    settling, state = _settling(state, load, now_s)
    if load.num_requests or state.busy_s is None:
        state = replace(state, busy_s=now_s)
    low, high = settings.min_replicas, settings.max_replicas
    if current < low or current > high:
        return min(max(current, low), high), replace(state, up_since_s=None)
    if current == 0:
        wake = load.num_queued > 0 or load.num_requests > 0
        return (max(1, low) if wake else 0), replace(state, up_since_s=None)
    up, fits = wanted(load, settings, state, settling)
    if (load.num_starting or settling) and up <= 2 * current:  # what starts (or just started) was asked for
        up = current
    if up > current:
        since = now_s if state.up_since_s is None else state.up_since_s
        if now_s - since >= settings.upscale_delay_s:
            return min(up, high), replace(state, up_since_s=None)
        return current, replace(state, up_since_s=since)
    state = replace(state, up_since_s=None)
    if low == 0 and current == 1 and not load.num_requests and now_s - (state.busy_s or now_s) >= settings.idle_s:
        return (0 if not load.num_starting else current), state
    young = now_s - (state.since_s if state.since_s is not None else now_s) < settings.downscale_delay_s
    if fits >= current or current - 1 < max(low, 1) or load.num_starting or young:
        return current, state
    return max(fits, low, 1, math.ceil(current / 2)), state  # at most half at once, as Knative's KPA
