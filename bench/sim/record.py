"""What a simulated run measured: how each request ended, and its latencies, the replicas' work
and the adapters' moves (bench/sim/fleet.py fills it; report.py and plots.py read it)."""

from __future__ import annotations

from dataclasses import dataclass, field

OUTCOMES = ("completed", "refused_rate", "refused_busy", "failed_no_replica", "failed_too_long", "failed_replica_lost")


@dataclass
class RunRecord:
    """What a run measured; requests arriving before warmup_s count in `outcomes` only."""

    router: str
    num_replicas: int
    outcomes: dict[str, int] = field(default_factory=lambda: dict.fromkeys(OUTCOMES, 0))
    num_measured: int = 0
    measured: dict[str, dict[str, int]] = field(default_factory=dict)  # tenant -> outcome -> measured requests
    tenants: list[str] = field(default_factory=list)  # per completed measured request, aligned with ttft_s
    arrivals: list[float] = field(default_factory=list)  # per completed measured request: when it arrived
    ttft_s: list[float] = field(default_factory=list)  # per completed measured request
    itl_s: list[float] = field(default_factory=list)  # its mean gap between tokens (none for one token)
    queue_s: list[float] = field(default_factory=list)  # arrival at its replica to a KV slot
    prompt_tokens: int = 0
    cached_tokens: int = 0
    busy_s: list[float] = field(default_factory=list)  # per replica: time stepping
    slot_s: list[float] = field(default_factory=list)  # per replica: KV slots held x time
    num_seq_slots: int = 1
    gaps: dict[int, int] = field(default_factory=dict)  # every inter-token gap: 0.1 ms bucket -> count
    num_adapter_loads: int = 0
    load_times_s: list[float] = field(default_factory=list)  # when each adapter load began
    num_adapter_evictions: int = 0
    num_lower_loads: int = 0  # of the loads, from disk or the store (not on the host: profile.host_adapters)
    num_lost: int = 0  # requests a lost replica had (running, queued or loading an adapter for)
    num_lost_retried: int = 0  # of those, sent to another replica
    end_s: float = 0.0
    num_events: int = 0
    num_replans: int = 0
    num_pins_moved: int = 0  # adapters whose shards a re-plan changed
    num_new_versions: int = 0  # adapters replaced by a new version (registered, then served)
    num_unplaced: int = 0  # new versions place_new found no room for
    fetched_tokens: int = 0  # prompt tokens fetched from the shared tier (with its costs: the rest were in L1)
