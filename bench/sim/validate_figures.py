"""The simulated side of `python -m bench.sim.validate` and what it compares: the load tester's own
requests run through the simulator, and TTFT, ITL and throughput of the real run's report beside the
simulated run's, with the target figures off by more than TOLERANCE."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from unittest import mock

import bench.sim.fleet as fleet_module
from bench.sim.fleet import Fleet, place
from bench.sim.profile import CostProfile
from bench.sim.record import RunRecord
from bench.sim.replica import Seq
from bench.sim.report import _bucket_percentile, percentile
from bench.sim.workload import FleetScenario, SimRequest
from gateway.config import ServeConfig
from gateway.loadtest.generators import PlannedRequest
from gateway.loadtest.scenario import Scenario

NUM_REPLICAS = 2  # the real run's replicas of one shard, and the simulated fleet's


TOLERANCE = 0.15


def sim_requests(planned: Sequence[PlannedRequest], scenario: Scenario) -> list[SimRequest]:
    """The load tester's requests as the simulator takes them: a prompt is its shared prefix (which
    one, found by its tokens) and its own tokens' count."""
    p = scenario.prompts
    if p.kind == "shared_prefix" and p.length.max >= p.prefix_tokens + p.length.min:
        raise ValueError("own prompts as long as a prefix: which requests share one cannot be told from their lengths")
    prefixes: dict[tuple[int, ...], int] = {}
    out = []
    for i, r in enumerate(planned):
        prefix = -1
        if p.kind == "rag" or (p.kind == "shared_prefix" and len(r.prompt_ids) >= p.prefix_tokens + p.length.min):
            prefix = prefixes.setdefault(tuple(r.prompt_ids[: p.prefix_tokens]), len(prefixes))
        num_prefix = p.prefix_tokens if prefix >= 0 else 0
        out.append(SimRequest(i, r.at_s, r.tenant, r.adapter, prefix, num_prefix, len(r.prompt_ids) - num_prefix, r.max_tokens))
    return out


class TracedFleet(Fleet):
    """A Fleet that keeps each completed request's TTFT and mean gap by its index (to set beside its real twin)."""

    def __init__(self, *args, **kwargs) -> None:  # noqa: ANN002, ANN003 - Fleet's
        super().__init__(*args, **kwargs)
        self.by_index: dict[int, tuple[float, float | None]] = {}

    def _complete(self, seq: Seq) -> None:
        super()._complete(seq)
        request = seq.request
        gap_s = (seq.finished_s - seq.first_token_s) / (request.max_tokens - 1) if request.max_tokens > 1 else None
        self.by_index[request.index] = (seq.first_token_s - request.at_s + self.profile.hop_s, gap_s)


def simulated(fleet: FleetScenario, profile: CostProfile, config: ServeConfig,
              requests: list[SimRequest]) -> tuple[RunRecord, TracedFleet]:
    """The fleet of the served config ("ours" is its routing; a shared prefix tier when it has a
    Redis) on `requests`. Fleet.run draws its own requests from the scenario's seed (same
    distributions, other draws than the load tester's): this replays the load tester's instead."""
    run = TracedFleet(fleet, fleet.scenario, profile, place(fleet, NUM_REPLICAS), "ours", routing=config.routing,
                shared_cache=config.cache.redis is not None)
    with mock.patch.object(fleet_module, "requests", lambda _scenario: iter(requests)):
        return run.run(), run


def twins(report_path: Path, requests: list[SimRequest], run: TracedFleet) -> str:
    """Each measured real request beside its simulated twin (the same index: both in arrival order,
    checked by adapter and prompt length): the median TTFT difference, prefix hits and misses
    apart, and the median ratio of their mean gaps."""
    real = sorted(json.loads(report_path.read_text())["requests"], key=lambda r: r["start_s"])
    if len(real) != len(requests):
        return f"request by request: not paired ({len(real)} real requests, {len(requests)} planned)"
    diffs: dict[bool, list[float]] = {True: [], False: []}
    ratios = []
    for r, planned in zip(real, requests):
        twin = run.by_index.get(planned.index)
        if (r["status"] != 200 or twin is None or r["adapter"] != planned.adapter or r["prompt_tokens"] != planned.num_prompt_tokens
                or r["start_s"] < run.scenario.warmup_s):
            continue
        diffs[r["cached_tokens"] > 0].append(r["ttft_s"] - twin[0])
        if twin[1] and r["completion_tokens"] > 1:
            ratios.append(sum(r["itl_s"]) / (r["completion_tokens"] - 1) / twin[1])
    median = lambda values: percentile(values, 0.5)  # noqa: E731
    ms = lambda v: "n/a" if v is None or v != v else f"{1e3 * v:+.0f} ms"  # noqa: E731
    return (f"request by request (a real one minus its simulated twin, medians): TTFT {ms(median(diffs[True]))} for "
            f"{len(diffs[True])} prefix hits, {ms(median(diffs[False]))} for {len(diffs[False])} misses; mean gap x"
            f"{median(ratios):.2f} ({len(ratios)} requests)")


def real_figures(report_path: Path, scenario: Scenario) -> dict[str, float | None]:
    rows = [r for r in json.loads(report_path.read_text())["requests"] if r["start_s"] >= scenario.warmup_s]
    ok = [r for r in rows if r["status"] == 200 and r["ttft_s"] is not None]
    itl = [sum(r["itl_s"]) / (r["completion_tokens"] - 1) for r in ok if r["completion_tokens"] > 1]
    # at the workers (each answer's timings: the worker's time from first token to last), without the way back
    at_workers = [r["worker_decode_s"] / (r["completion_tokens"] - 1) for r in ok
                  if r["completion_tokens"] > 1 and r.get("worker_decode_s") is not None]
    measured_s = scenario.duration_s - scenario.warmup_s
    prompt = sum(r["prompt_tokens"] for r in ok)
    return {
        "ttft_p50_s": percentile([r["ttft_s"] for r in ok], 0.5), "ttft_p99_s": percentile([r["ttft_s"] for r in ok], 0.99),
        "itl_p50_s": percentile(itl, 0.5), "itl_p99_s": percentile(itl, 0.99),
        "worker_itl_p50_s": percentile(at_workers, 0.5) if at_workers else None,
        "worker_itl_p99_s": percentile(at_workers, 0.99) if at_workers else None,
        "gap_p99_s": percentile([g for r in ok for g in r["itl_s"]], 0.99),
        "completed_rps": len(ok) / measured_s, "output_tok_s": sum(r["completion_tokens"] for r in ok) / measured_s,
        "prefix_hit": sum(r["cached_tokens"] for r in ok) / prompt if prompt else None,
        "failed": len(rows) - len(ok),
    }


def sim_figures(record: RunRecord, requests: list[SimRequest], scenario: Scenario) -> dict[str, float | None]:
    measured_s = scenario.duration_s - scenario.warmup_s
    measured = [r for r in requests if r.at_s >= scenario.warmup_s]
    all_done = record.outcomes["completed"] == len(requests)  # then every measured one completed: its tokens are known
    return {
        "ttft_p50_s": percentile(record.ttft_s, 0.5), "ttft_p99_s": percentile(record.ttft_s, 0.99),
        "itl_p50_s": percentile(record.itl_s, 0.5), "itl_p99_s": percentile(record.itl_s, 0.99),
        "gap_p99_s": _bucket_percentile(record.gaps, 0.99),
        "completed_rps": len(record.ttft_s) / measured_s,
        "output_tok_s": sum(r.max_tokens for r in measured) / measured_s if all_done else None,
        "prefix_hit": record.cached_tokens / record.prompt_tokens if record.prompt_tokens else None,
        "failed": record.num_measured - len(record.ttft_s),
    }


def lone_figures(report_path: Path) -> tuple[float | None, float | None]:
    """Median TTFT and median mean gap of requests sent one at a time."""
    ok = [r for r in json.loads(report_path.read_text())["requests"] if r["status"] == 200 and r["completion_tokens"] > 1]
    return (percentile([r["ttft_s"] for r in ok], 0.5),
            percentile([sum(r["itl_s"]) / (r["completion_tokens"] - 1) for r in ok], 0.5))


ROWS = [("ttft_p50_s", "TTFT p50 (s)", "{:.3f}"), ("ttft_p99_s", "TTFT p99 (s)", "{:.3f}"),
        ("itl_p50_s", "ITL p50 (s, a request's mean gap)", "{:.4f}"), ("itl_p99_s", "ITL p99 (s, a request's mean gap)", "{:.4f}"),
        ("completed_rps", "throughput (requests/s)", "{:.2f}"), ("output_tok_s", "throughput (output tokens/s)", "{:.1f}"),
        ("gap_p99_s", "gap p99 (s, every gap; not a target)", "{:.4f}"), ("prefix_hit", "prompt tokens cached (not a target)", "{:.1%}")]


TARGETS = ("ttft_p50_s", "ttft_p99_s", "itl_p50_s", "itl_p99_s", "completed_rps", "output_tok_s")


def table(real: dict[str, float | None], sim: dict[str, float | None]) -> tuple[str, list[str]]:
    """The Markdown table, and the target figures off by more than TOLERANCE."""
    lines = ["| figure | real | simulated | error |", "|---|---|---|---|"]
    off = []
    for key, title, fmt in ROWS:
        r, s = real[key], sim[key]
        error = (s / r - 1) if r and s is not None else None
        if key in TARGETS and (error is None or abs(error) > TOLERANCE):
            off.append(key)
        cell = lambda v: "n/a" if v is None else fmt.format(v)  # noqa: E731
        lines.append(f"| {title} | {cell(r)} | {cell(s)} | {'n/a' if error is None else f'{error:+.1%}'} |")
    return "\n".join(lines), off
