"""Routing policies under skew, and a noisy tenant, measured side by side on this machine.

    python bench/routing_under_skew.py [--config deploy/bench-4.yaml] [--duration 90] [--out bench-out]

For each policy (affinity, random, least_loaded): serve the config with that policy
(a fresh cache namespace each, so every policy starts cold), run the zipf scenario,
stop. Then, under affinity: the quiet tenant alone (unloaded) and with the noisy
tenant (loaded). Prints the table of the README's load-testing section.
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import yaml

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


def loadtest(scenario: Path, port: int, out: Path, duration: float | None) -> dict:
    command = [sys.executable, "-m", "gateway.cli", "loadtest", "--scenario", str(scenario), "--url", f"http://127.0.0.1:{port}",
               "--out", str(out), "--quiet"]
    if duration:
        command += ["--duration", str(duration)]
    subprocess.run(command, check=True, capture_output=True, text=True)
    return json.loads((out / "report.json").read_text())["summary"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(ROOT / "deploy" / "bench-4.yaml"))
    parser.add_argument("--duration", type=float, help="override the scenarios' duration_s")
    parser.add_argument("--port", type=int, default=8391)
    parser.add_argument("--out", default="bench-out")
    parser.add_argument("--policies", default="affinity,random,least_loaded")
    parser.add_argument("--no-redis", action="store_true", help="worker-local caches only: what routing alone does for cache locality")
    parser.add_argument("--no-noisy", action="store_true", help="skip the noisy-tenant runs")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    base = yaml.safe_load(Path(args.config).read_text())
    for adapter in base["adapters"]:
        adapter["path"] = str((Path(args.config).parent / adapter["path"]).resolve())
    if args.no_redis:
        base["cache"] = {**base.get("cache", {}), "redis_url": None}
    rows = {}
    for policy in args.policies.split(","):
        config = {**base, "routing": policy, "cache": {**base.get("cache", {}), "key_prefix": f"loraplex-bench-{uuid.uuid4().hex[:8]}"}}
        server = serve(config, out, args.port)
        try:
            warm_up(args.port, out)
            rows[policy] = loadtest(SCENARIOS / "zipf.yaml", args.port, out / f"zipf-{policy}", args.duration)
        finally:
            stop(server)
        s = rows[policy]
        print(f"{policy:13s} max/mean {s['replicas']['max_over_mean']:.2f}  achieved/ideal {s['cache']['achieved_over_ideal']:.2f}  "
              f"p99 TTFT {s['latency']['ttft_s']['p99'] * 1e3:.0f} ms  p50 TTFT {s['latency']['ttft_s']['p50'] * 1e3:.0f} ms  "
              f"({s['latency']['ok']}/{s['latency']['requests']} ok)", flush=True)
    if args.no_noisy:
        return
    config = {**base, "routing": "affinity", "cache": {**base.get("cache", {}), "key_prefix": f"loraplex-bench-{uuid.uuid4().hex[:8]}"}}
    server = serve(config, out, args.port)
    try:
        warm_up(args.port, out)
        noisy = yaml.safe_load((SCENARIOS / "noisy-tenant.yaml").read_text())
        quiet_only = {**noisy, "name": "quiet-alone", "tenants": [t for t in noisy["tenants"] if "rate_rps" not in t]}
        (out / "quiet-alone.yaml").write_text(yaml.safe_dump(quiet_only))
        alone = loadtest(out / "quiet-alone.yaml", args.port, out / "quiet-alone", args.duration)
        loaded = loadtest(SCENARIOS / "noisy-tenant.yaml", args.port, out / "noisy-tenant", args.duration)
    finally:
        stop(server)
    quiet = loaded["per_tenant"]["demo"]["ttft_s"]["p99"]
    print(f"quiet tenant p99 TTFT: alone {alone['latency']['ttft_s']['p99'] * 1e3:.0f} ms, beside the noisy one {quiet * 1e3:.0f} ms "
          f"(x{quiet / alone['latency']['ttft_s']['p99']:.2f}); noisy tenant answers by status: "
          f"200: {loaded['per_tenant']['acme']['ok']}, others: {loaded['errors_by_status']}")


if __name__ == "__main__":
    main()
