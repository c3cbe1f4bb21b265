"""What bench/autoscale_burst.py reads from the gateway while a burst runs (each replica's phase and
route decisions, every request's outcome) and the arithmetic over it, pure; `real_figures` reads
them as bench/sim/burst.py reads a simulated run, for the two side by side."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from bench.sim.burst import BurstFigures, replica_seconds

LETTERS = {"up": "U", "starting": "S", "draining": "D", "asleep": "A"}
COSTING = ("starting", "up", "draining")  # a replica's phases that hold its node


@dataclass(frozen=True)
class Sample:
    """One reading of the gateway: each replica's phase and route decisions, by replica index."""

    at_s: float  # time.monotonic()
    phases: tuple[str, ...]
    routed: tuple[float, ...]


@dataclass(frozen=True)
class Request:
    started_s: float  # time.monotonic()
    ended_s: float
    is_ok: bool
    is_streamed: bool
    replica: str
    ttft_s: float | None = None
    why: str = ""  # what failed: the status and the body's start, the error event, the transport's error


def letters(phases: Sequence[str]) -> str:
    return "".join(LETTERS.get(p, "?") for p in phases)


def at_min(phases: Sequence[str], min_replicas: int) -> bool:
    return all(p == "up" for p in phases[:min_replicas]) and all(p == "asleep" for p in phases[min_replicas:])


def timeline(samples: Sequence[Sample], origin_s: float) -> str:
    """The phases each time they changed, in seconds from `origin_s`."""
    out, last = [], None
    for s in samples:
        if s.phases != last:
            out.append(f"{s.at_s - origin_s:+.1f} s {letters(s.phases)}")
            last = s.phases
    return " | ".join(out)


def first_after(samples: Sequence[Sample], after_s: float, holds) -> float | None:
    """When the first sample at or after `after_s` for which `holds(sample)` was taken."""
    return next((s.at_s for s in samples if s.at_s >= after_s and holds(s)), None)


def scale_up(samples: Sequence[Sample], requests: Sequence[Request], replica: str, index: int,
             burst_s: float) -> dict[str, float | None]:
    """Seconds from the burst's start until replica `index` was starting, up, routed to, and first answered."""
    before = next((s.routed[index] for s in reversed(samples) if s.at_s <= burst_s), 0.0)

    def since(at: float | None) -> float | None:
        return None if at is None else at - burst_s

    answers = [r.started_s + (r.ttft_s or r.ended_s - r.started_s) for r in requests
               if r.replica == replica and r.is_ok and r.started_s >= burst_s]
    return {"starting": since(first_after(samples, burst_s, lambda s: s.phases[index] in ("starting", "up"))),
            "up": since(first_after(samples, burst_s, lambda s: s.phases[index] == "up")),
            "routed": since(first_after(samples, burst_s, lambda s: s.routed[index] > before)),
            "answered": since(min(answers, default=None))}


def first_leaving(samples: Sequence[Sample], after_s: float) -> float | None:
    """When a replica that was up was first seen draining or asleep, at or after `after_s` (one that
    drains between two readings is seen asleep at once)."""
    for before, now in zip(samples, samples[1:]):
        if now.at_s >= after_s and any(b == "up" and n in ("draining", "asleep") for b, n in zip(before.phases, now.phases)):
            return now.at_s
    return None


def failed_between(requests: Sequence[Request], from_s: float, to_s: float) -> list[Request]:
    """Requests that failed and were in flight at some time in [from_s, to_s]."""
    return [r for r in requests if not r.is_ok and r.started_s <= to_s and r.ended_s >= from_s]


def real_figures(samples: Sequence[Sample], requests: Sequence[Request], ups: Sequence[dict[str, float | None]],
                 times: tuple[float, float, float | None], most: int, ttft_p50_s: float) -> BurstFigures:
    """The run's figures: `ups`, each new replica's `scale_up`; `times`, the burst's start, its end and when
    the shard was back at min_replicas (None: never); `most`, replicas up at most."""
    t0, burst_end, back = times
    costing = [(s.at_s, sum(p in COSTING for p in s.phases)) for s in samples]
    return BurstFigures(tuple(u["starting"] for u in ups), tuple(u["answered"] for u in ups),
                        None if back is None else back - burst_end, most, len(requests), sum(not r.is_ok for r in requests),
                        replica_seconds(costing, t0, samples[-1].at_s if back is None else back), ttft_p50_s)
