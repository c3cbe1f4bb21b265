"""What a run measured: a JSON report, a Markdown summary and PNG plots."""

from __future__ import annotations

import json
import math
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

from gateway.loadtest.runner import Result
from gateway.loadtest.scenario import Scenario


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q / 100 * len(ordered)) - 1))]


def _latencies(results: list[Result]) -> dict[str, Any]:
    ok = [r for r in results if r.status == 200]
    ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
    itl = [gap for r in ok for gap in r.itl_s]
    e2e = [r.e2e_s for r in ok if r.e2e_s is not None]
    out: dict[str, Any] = {"requests": len(results), "ok": len(ok)}
    for name, values in (("ttft_s", ttft), ("itl_s", itl), ("e2e_s", e2e)):
        out[name] = {f"p{q}": percentile(values, q) for q in (50, 90, 99)}
    return out


def summarize(scenario: Scenario, results: list[Result], wall_s: float) -> dict[str, Any]:
    """Figures over the requests sent after the warm-up (all of them when warmup_s is 0)."""
    warmup = [r for r in results if r.start_s < scenario.warmup_s]
    results = [r for r in results if r.start_s >= scenario.warmup_s]
    wall_s = max(wall_s - scenario.warmup_s, 1e-9)
    ok = [r for r in results if r.status == 200]
    prompt = sum(r.prompt_tokens for r in ok)
    cached = sum(r.cached_tokens for r in ok)
    ideal = sum(r.ideal_cached for r in ok)
    replicas = Counter(r.replica for r in ok if r.replica)
    mean_load = sum(replicas.values()) / len(replicas) if replicas else 0
    good = [r for r in ok if r.ttft_s is not None and r.ttft_s <= scenario.slo.ttft_s and r.e2e_s <= scenario.slo.e2e_s]
    by = {"tenant": defaultdict(list), "adapter": defaultdict(list)}
    for r in results:
        by["tenant"][r.tenant].append(r)
        by["adapter"][r.adapter].append(r)
    return {
        "scenario": scenario.name, "seed": scenario.seed, "wall_s": wall_s,
        "warmup": {"seconds": scenario.warmup_s, "requests_left_out": len(warmup)},
        "throughput": {"requests_per_s": len(ok) / wall_s, "output_tokens_per_s": sum(r.completion_tokens for r in ok) / wall_s,
                       "prompt_tokens_per_s": prompt / wall_s},
        "latency": _latencies(results),
        "per_tenant": {k: _latencies(v) for k, v in sorted(by["tenant"].items())},
        "per_adapter": {k: _latencies(v) for k, v in sorted(by["adapter"].items())},
        "errors_by_status": {str(k): v for k, v in sorted(Counter(r.status for r in results if r.status != 200).items())},
        "cache": {"prompt_tokens": prompt, "cached_tokens": cached, "ideal_cached_tokens": ideal,
                  "cached_share": cached / prompt if prompt else 0.0, "ideal_share": ideal / prompt if prompt else 0.0,
                  "achieved_over_ideal": cached / ideal if ideal else None},
        "replicas": {"requests": dict(sorted(replicas.items())), "max_over_mean": max(replicas.values()) / mean_load if replicas else None},
        "goodput": {"slo": scenario.slo.model_dump(), "requests_per_s": len(good) / wall_s,
                    "share": len(good) / len(results) if results else 0.0},
    }


def markdown(summary: dict[str, Any]) -> str:
    def ms(v: float | None) -> str:
        return "-" if v is None else f"{v * 1e3:.0f}"

    lat = summary["latency"]
    achieved = summary["cache"]["achieved_over_ideal"]
    lines = [
        f"# Load test: {summary['scenario']} (seed {summary['seed']}, {summary['wall_s']:.0f} s)", "",
        f"- requests: {lat['requests']} ({lat['ok']} ok; {summary['warmup']['requests_left_out']} more in the first "
        f"{summary['warmup']['seconds']:g} s of warm-up, left out); errors by status: {summary['errors_by_status'] or 'none'}",
        f"- throughput: {summary['throughput']['requests_per_s']:.2f} requests/s, "
        f"{summary['throughput']['output_tokens_per_s']:.1f} output tokens/s",
        f"- cached prompt tokens: {summary['cache']['cached_share']:.1%} (ideal {summary['cache']['ideal_share']:.1%}; "
        f"achieved/ideal {achieved if achieved is None else format(achieved, '.2f')})",
        f"- replica load max/mean: {summary['replicas']['max_over_mean'] and format(summary['replicas']['max_over_mean'], '.2f')} "
        f"{summary['replicas']['requests']}",
        f"- goodput (TTFT <= {summary['goodput']['slo']['ttft_s']} s, end to end <= {summary['goodput']['slo']['e2e_s']} s): "
        f"{summary['goodput']['requests_per_s']:.2f} requests/s ({summary['goodput']['share']:.0%})", "",
        "| group | requests | TTFT p50 / p90 / p99 (ms) | ITL p50 / p99 (ms) | end to end p50 / p99 (ms) |", "|---|---|---|---|---|",
    ]
    rows = (
        [("all", lat)]
        + [(f"tenant {k}", v) for k, v in summary["per_tenant"].items()]
        + [(f"adapter {k}", v) for k, v in summary["per_adapter"].items()]
    )
    for name, v in rows:
        t, i, e = v["ttft_s"], v["itl_s"], v["e2e_s"]
        lines.append(f"| {name} | {v['requests']} | {ms(t['p50'])} / {ms(t['p90'])} / {ms(t['p99'])} | "
                     f"{ms(i['p50'])} / {ms(i['p99'])} | {ms(e['p50'])} / {ms(e['p99'])} |")
    lines += ["", "Plots: latency_cdf.png, throughput.png, ttft_per_adapter.png, replica_load.png, cache_hit.png", ""]
    return "\n".join(lines)


def cache_share_over_time(results: list[Result], window_s: float) -> tuple[list[float], list[float], list[float]]:
    """At each answered request's end: the cached and the ideal share of the prompt tokens of the
    requests that ended in the `window_s` seconds before it."""
    ok = sorted((r for r in results if r.status == 200), key=lambda r: r.start_s + (r.e2e_s or 0))
    times, achieved, ideal = [], [], []
    first, prompt, cached, seen = 0, 0, 0, 0
    for r in ok:
        end = r.start_s + (r.e2e_s or 0)
        prompt, cached, seen = prompt + r.prompt_tokens, cached + r.cached_tokens, seen + r.ideal_cached
        while ok[first].start_s + (ok[first].e2e_s or 0) <= end - window_s:
            old = ok[first]
            prompt, cached, seen = prompt - old.prompt_tokens, cached - old.cached_tokens, seen - old.ideal_cached
            first += 1
        times.append(end)
        achieved.append(cached / prompt if prompt else 0.0)
        ideal.append(seen / prompt if prompt else 0.0)
    return times, achieved, ideal


class PNGs:
    """Figures drawn off screen and saved into `out` as PNGs; `written` names them in order."""

    def __init__(self, out: Path) -> None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        self.out, self.plt, self.written = out, plt, []

    def save(self, fig: Any, name: str) -> None:
        fig.tight_layout()
        fig.savefig(self.out / name, dpi=100)
        self.plt.close(fig)
        self.written.append(name)


def plots(results: list[Result], summary: dict[str, Any], out: Path) -> list[str]:
    pngs = PNGs(out)
    plt, save, written = pngs.plt, pngs.save, pngs.written
    ok = [r for r in results if r.status == 200]

    fig, ax = plt.subplots(figsize=(6, 4))
    for label, values in (("TTFT", [r.ttft_s for r in ok if r.ttft_s is not None]), ("end to end", [r.e2e_s for r in ok if r.e2e_s])):
        values = sorted(values)
        if values:
            ax.plot(values, [(i + 1) / len(values) for i in range(len(values))], label=label)
    ax.set(xlabel="seconds", ylabel="fraction of requests", title="latency CDF")
    ax.legend()
    save(fig, "latency_cdf.png")

    end = max((r.start_s + (r.e2e_s or 0) for r in ok), default=1.0)
    bins = max(1, int(math.ceil(end)))
    done, tokens = [0] * bins, [0] * bins
    for r in ok:
        b = min(bins - 1, int(r.start_s + (r.e2e_s or 0)))
        done[b] += 1
        tokens[b] += r.completion_tokens
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(range(bins), done, label="requests/s")
    ax.plot(range(bins), [t / 10 for t in tokens], label="output tokens/s ÷ 10")
    ax.set(xlabel="seconds into the run", title="throughput over time")
    ax.legend()
    save(fig, "throughput.png")

    per_adapter = defaultdict(list)
    for r in ok:
        if r.ttft_s is not None:
            per_adapter[r.adapter].append(r.ttft_s)
    fig, ax = plt.subplots(figsize=(6, 4))
    names = sorted(per_adapter)
    if names:
        ax.boxplot([per_adapter[n] for n in names], tick_labels=names)
    ax.set(ylabel="TTFT (s)", title="TTFT per adapter")
    save(fig, "ttft_per_adapter.png")

    fig, ax = plt.subplots(figsize=(6, 4))
    replicas = summary["replicas"]["requests"]
    ax.bar(list(replicas), list(replicas.values()))
    ax.set(ylabel="requests", title=f"load per replica (max/mean {summary['replicas']['max_over_mean'] or 0:.2f})")
    save(fig, "replica_load.png")

    fig, ax = plt.subplots(figsize=(6, 4))
    times, achieved, ideal = cache_share_over_time(results, window_s=5.0)
    ax.plot(times, achieved, label="achieved")
    ax.plot(times, ideal, linestyle="--", label="ideal (chunks seen before)")
    ax.set(xlabel="seconds into the run", ylabel="cached share of prompt tokens", title="cache hits over time (5 s window)", ylim=(0, 1))
    ax.legend()
    save(fig, "cache_hit.png")
    return written


def write_report(scenario: Scenario, results: list[Result], wall_s: float, out: Path) -> dict[str, Any]:
    out.mkdir(parents=True, exist_ok=True)
    summary = summarize(scenario, results, wall_s)
    summary["plots"] = plots(results, summary, out)
    (out / "report.json").write_text(json.dumps({"summary": summary, "requests": [r.as_dict() for r in results]}, indent=1))
    (out / "report.md").write_text(markdown(summary))
    return summary
