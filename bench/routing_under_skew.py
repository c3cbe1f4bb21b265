"""Routing policies under skew, and a noisy tenant, measured side by side on this machine.

    python bench/routing_under_skew.py [--config deploy/bench-4.yaml] [--duration 90] [--rounds 2] [--replicas N] [--out bench-out]

Each round, for each policy (affinity, random, least_loaded): serve the config with
that policy (a fresh cache namespace each, so every run starts cold), run the zipf
scenario (another seed each round), stop. Then, under affinity, rounds of the quiet
tenant alone (unloaded) and with the noisy tenant (loaded), interleaved. Each figure
pools the measured requests of its rounds: a p99 over one short run is its slowest
request or two. Prints the table of docs/benchmarks.md#routing-under-skew.
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import time
import urllib.request
import uuid
from collections import Counter
from pathlib import Path

import yaml
from prometheus_client.parser import text_string_to_metric_families

from bench.server import loadtest as run_loadtest
from gateway.loadtest.report import cache_share_over_time, percentile
from gateway.loadtest.runner import Result

OPERATOR_KEY = "sk-loraplex-operator"  # deploy/bench-4.yaml's

ROOT = Path(__file__).resolve().parent.parent
SCENARIOS = ROOT / "deploy" / "scenarios"


def warm_up(port: int, out: Path) -> None:
    """Every replica's first requests pay one-time costs: spend them on unrelated random prompts."""
    loadtest(SCENARIOS / "uniform.yaml", port, out / "warm-up", 12.0)


def serve(config: dict, base: Path, port: int) -> subprocess.Popen:
    path = base / f"serve-{uuid.uuid4().hex[:6]}.yaml"
    path.write_text(yaml.safe_dump(config))
    process = subprocess.Popen([sys.executable, "-m", "gateway.cli", "serve", "--config", str(path), "--port", str(port)],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 600
    for line in process.stdout:
        if "ready in" in line:
            return process
        if time.monotonic() > deadline:
            break
    process.kill()
    raise RuntimeError("the server did not start")


def stop(process: subprocess.Popen) -> None:
    process.send_signal(signal.SIGINT)
    try:
        process.wait(120)
    except subprocess.TimeoutExpired:
        process.kill()


def loadtest(
    scenario: Path, port: int, out: Path, duration: float | None, seed: int | None = None, max_requests: int | None = None
) -> Path:
    return run_loadtest(scenario, f"http://127.0.0.1:{port}", out, duration_s=duration or None, seed=seed, max_requests=max_requests)


def cache_counters(port: int) -> Counter:
    """The workers' prefix-cache counters, summed over replicas, from the gateway's /metrics."""
    request = urllib.request.Request(f"http://127.0.0.1:{port}/metrics", headers={"Authorization": f"Bearer {OPERATOR_KEY}"})
    text = urllib.request.urlopen(request, timeout=30).read().decode()
    totals: Counter = Counter()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "loraplex_cache_hit_chunks_total":
                totals[sample.labels["tier"]] += sample.value
            elif sample.name == "loraplex_cache_read_bytes_total":
                totals["l2_bytes"] += sample.value
    return totals


def measured(reports: list[Path], tenant: str | None = None) -> list[dict]:
    """The requests of several runs that their reports measured (sent after the warm-up)."""
    rows = []
    for path in reports:
        report = json.loads(path.read_text())
        warmup = report["summary"]["warmup"]["seconds"]
        rows += [r for r in report["requests"] if r["start_s"] >= warmup and (tenant is None or r["tenant"] == tenant)]
    return rows


def ttft_ms(rows: list[dict], q: float) -> float:
    return percentile([r["ttft_s"] for r in rows if r["status"] == 200 and r["ttft_s"] is not None], q) * 1e3


def zipf_row(reports: list[Path]) -> str:
    rows = [r for r in measured(reports) if r["status"] == 200]
    per_run = [json.loads(p.read_text())["summary"]["replicas"]["max_over_mean"] for p in reports]
    ideal = sum(r["ideal_cached"] for r in rows)
    return (f"max/mean {sum(per_run) / len(per_run):.2f}  achieved/ideal {sum(r['cached_tokens'] for r in rows) / ideal:.2f}  "
            f"p50 TTFT {ttft_ms(rows, 50):.0f} ms  p90 {ttft_ms(rows, 90):.0f} ms  p99 {ttft_ms(rows, 99):.0f} ms  ({len(rows)} requests)")


def plot_cache_hits(zipf: dict[str, list[Path]], path: Path, window_s: float = 10.0) -> None:
    """Cached share of prompt tokens over time, each policy's first round against the ideal."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for i, (policy, reports) in enumerate(zipf.items()):
        results = [Result(**row) for row in json.loads(reports[0].read_text())["requests"]]
        times, achieved, ideal = cache_share_over_time(results, window_s)
        ax.plot(times, achieved, color=f"C{i}", label=f"{policy}: achieved")
        if i == 0:
            ax.plot(times, ideal, color="black", linestyle="--", label="ideal (chunks seen before)")
    ax.set(xlabel="seconds into the run", ylabel="cached share of prompt tokens", ylim=(0, 1),
           title=f"zipf scenario: cache hits by routing policy ({window_s:g} s window)")
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(ROOT / "deploy" / "bench-4.yaml"))
    parser.add_argument("--duration", type=float, help="override the scenarios' duration_s")
    parser.add_argument("--replicas", type=int, help="replicas per shard instead of the config's (2 here: one per core)")
    parser.add_argument("--rounds", type=int, default=2, help="runs of each, interleaved, whose requests are pooled")
    parser.add_argument("--port", type=int, default=8391)
    parser.add_argument("--out", default="bench-out")
    parser.add_argument("--policies", default="affinity,random,least_loaded")
    parser.add_argument("--no-redis", action="store_true", help="worker-local caches only: what routing alone does for cache locality")
    parser.add_argument("--no-noisy", action="store_true", help="skip the noisy-tenant runs")
    return parser.parse_args()


def read_config(args: argparse.Namespace) -> dict:
    """The config to serve: its adapters' paths made absolute, with the flags' replicas and Redis."""
    base = yaml.safe_load(Path(args.config).read_text())
    for adapter in base["adapters"]:
        adapter["path"] = str((Path(args.config).parent / adapter["path"]).resolve())
    if args.replicas:
        base["shards"] = [{**shard, "replicas": args.replicas} for shard in base["shards"]]
    if args.no_redis:
        base["cache"] = {**base.get("cache", {}), "redis_url": None}
    return base


def fresh(base: dict, policy: str) -> dict:
    """`base` routing by `policy` with a new cache namespace, so every run starts cold."""
    cache = {**base.get("cache", {}), "key_prefix": f"loraplex-bench-{uuid.uuid4().hex[:8]}"}
    return {**base, "routing": {**base.get("routing", {}), "policy": policy}, "cache": cache}


def zipf_rounds(args: argparse.Namespace, base: dict, out: Path, policies: list[str]) -> tuple[dict[str, list[Path]], dict[str, Counter]]:
    """Each round, the zipf scenario under each policy: its reports and cache-tier counters per policy."""
    zipf: dict[str, list[Path]] = {p: [] for p in policies}
    tiers: dict[str, Counter] = {p: Counter() for p in policies}
    for round_ in range(args.rounds):
        for policy in policies:
            server = serve(fresh(base, policy), out, args.port)
            try:
                warm_up(args.port, out)
                before = cache_counters(args.port)
                zipf[policy].append(
                    loadtest(SCENARIOS / "zipf.yaml", args.port, out / f"zipf-{policy}-{round_}", args.duration, 2 + round_)
                )
                tiers[policy].update(cache_counters(args.port) - before)
            finally:
                stop(server)
            print(f"round {round_ + 1}: {policy:13s} {zipf_row(zipf[policy][-1:])}", flush=True)
    return zipf, tiers


def print_zipf(policies: list[str], zipf: dict[str, list[Path]], tiers: dict[str, Counter]) -> None:
    for policy in policies:
        t, runs = tiers[policy], zipf[policy]
        requests = sum(len(json.loads(p.read_text())["requests"]) for p in runs)
        print(f"{policy:13s} {zipf_row(runs)}\n{'':13s} cached chunks from the worker's own memory (L1) "
              f"{t['l1'] / max(t['l1'] + t['l2'], 1):.0%}, "
              f"from Redis {t['l2'] / max(t['l1'] + t['l2'], 1):.0%}; "
              f"{t['l2_bytes'] / requests / 1e6:.2f} MB read from Redis per request", flush=True)


def noisy_rounds(args: argparse.Namespace, base: dict, out: Path) -> tuple[list[Path], list[Path]]:
    """Under affinity, the quiet tenant's rounds alone and beside the noisy tenant: their reports."""
    server = serve(fresh(base, "affinity"), out, args.port)
    alone, loaded = [], []
    try:
        warm_up(args.port, out)
        noisy = yaml.safe_load((SCENARIOS / "noisy-tenant.yaml").read_text())
        quiet_only = {**noisy, "name": "quiet-alone", "tenants": [t for t in noisy["tenants"] if "rate_rps" not in t]}
        (out / "quiet-alone.yaml").write_text(yaml.safe_dump(quiet_only))
        for round_ in range(args.rounds):  # the same quiet traffic (seed) alone and beside the noisy tenant
            alone.append(loadtest(out / "quiet-alone.yaml", args.port, out / f"quiet-alone-{round_}", args.duration, 4 + round_))
            # as many requests as the whole duration takes (8.5/s), so both runs cover the same time
            loaded.append(
                loadtest(SCENARIOS / "noisy-tenant.yaml", args.port, out / f"noisy-tenant-{round_}", args.duration, 4 + round_, 100_000)
            )
    finally:
        stop(server)
    return alone, loaded


def print_noisy(alone: list[Path], loaded: list[Path]) -> None:
    quiet_alone, quiet_loaded, noisy_rows = measured(alone, "demo"), measured(loaded, "demo"), measured(loaded, "acme")
    for q in (50, 90, 99):
        print(f"quiet tenant p{q} TTFT: alone {ttft_ms(quiet_alone, q):.0f} ms, beside the noisy one {ttft_ms(quiet_loaded, q):.0f} ms "
              f"(x{ttft_ms(quiet_loaded, q) / ttft_ms(quiet_alone, q):.2f}; {len(quiet_alone)} and {len(quiet_loaded)} requests)")
    statuses = Counter(r["status"] for r in noisy_rows)
    print(f"noisy tenant answers by status: {dict(sorted(statuses.items()))}")


def main() -> None:
    args = parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    base = read_config(args)
    policies = [p for p in args.policies.split(",") if p]
    zipf, tiers = zipf_rounds(args, base, out, policies)
    if policies:
        plot_cache_hits(zipf, out / "cache_hit_by_policy.png")
    print_zipf(policies, zipf, tiers)
    if args.no_noisy:
        return
    print_noisy(*noisy_rounds(args, base, out))


if __name__ == "__main__":
    main()
