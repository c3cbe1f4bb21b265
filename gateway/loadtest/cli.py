"""`loraplex loadtest --scenario FILE --url URL [--duration S] [--seed N] [--out DIR]`."""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

import httpx

from gateway.config import ConfigError
from gateway.loadtest.generators import plan_workload
from gateway.loadtest.report import write_report
from gateway.loadtest.runner import run_workload
from gateway.loadtest.scenario import load_scenario


def _server_facts(url: str, key: str, alora: str | None) -> tuple[str, list[int]]:
    """The base model's name (from /v1/models) and the aLoRA's invocation tokens (from /lora-adapters)."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    models = httpx.get(f"{url}/v1/models", headers=headers, timeout=30)
    models.raise_for_status()
    base = models.json()["data"][0]["id"]
    invocation: list[int] = []
    if alora:
        listing = httpx.get(f"{url}/lora-adapters", headers=headers, timeout=30).json()
        entry = next((a for a in listing if a.get("name") == alora), None)
        if entry is None or not entry.get("alora_invocation_tokens"):
            raise ConfigError(f"the server has no aLoRA named {alora!r} for this key")
        invocation = entry["alora_invocation_tokens"]
    return base, invocation


def run(args: argparse.Namespace) -> int:
    try:
        scenario = load_scenario(args.scenario)
        updates = {
            k: v for k, v in (("duration_s", args.duration), ("seed", args.seed), ("max_requests", args.max_requests)) if v is not None
        }
        if updates:
            scenario = scenario.model_copy(update=updates)
        url = args.url.rstrip("/")
        if not url.startswith(("http://", "https://")):
            raise ConfigError(f"--url must be an http(s) URL, got {args.url!r}")
        base, invocation = _server_facts(url, scenario.tenants[0].key, scenario.prompts.alora_adapter)
        workload = plan_workload(scenario, invocation)
    except (ConfigError, httpx.HTTPError, ValueError) as e:
        print(f"loraplex loadtest: {e}", file=sys.stderr)
        return 2
    keys = {t.name: t.key for t in scenario.tenants}
    print(f"loraplex loadtest: {scenario.name}: {len(workload.requests)} requests over up to {scenario.duration_s:g} s against {url} "
          f"({scenario.load.mode} loop)", file=sys.stderr)
    started = time.perf_counter()
    results = asyncio.run(run_workload(scenario, url, workload.requests, base, keys, progress=not args.quiet))
    wall_s = time.perf_counter() - started
    out = Path(args.out or f"loadtest-{scenario.name}")
    summary = write_report(scenario, results, wall_s, out)
    print((out / "report.md").read_text())
    print(f"loraplex loadtest: report in {out}/ (report.json, report.md, {', '.join(summary['plots'])})", file=sys.stderr)
    return 0
