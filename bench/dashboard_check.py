"""Does every panel of the Helm chart's Grafana dashboard show data? Starts `loraplex serve` (the
default deployment: deploy/serve.yaml) and a real Prometheus scraping its /metrics with the
operator's key, puts load on it (several tenants and adapters, repeated prefixes, streamed and
whole, and refusals: a bad key, an unknown model, a bad body, a rate limit), then runs each
panel's query through Prometheus' HTTP API and prints which return data. Exits 1 when one
returns none; 2 when there is no `prometheus` binary (Debian: `apt-get install prometheus`;
the project does not depend on it).

    python -m bench.dashboard_check [--seconds 40] [--prometheus /usr/bin/prometheus]
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import math
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import httpx
import redis
import yaml

from bench.server import ROOT, Server, base_config, delete_keys

DASHBOARD = ROOT / "helm" / "loraplex" / "dashboards" / "loraplex.json"
GRAFANA_VARIABLES = {"$__rate_interval": "2m", "$__interval": "15s"}  # what Grafana fills in; the whole load fits 2m
OPERATOR_KEY = "sk-dashboard-operator"
TENANT_KEYS = {"alpha": "sk-dashboard-alpha", "beta": "sk-dashboard-beta", "tight": "sk-dashboard-tight"}
SCRAPE_INTERVAL_S = 2
METRIC = re.compile(r"\bloraplex_[a-z0-9_]+\b")


def panel_queries(dashboard: dict) -> list[tuple[str, str]]:
    """(panel title, PromQL) of every query of every panel, rows' panels included."""
    out = []
    for panel in dashboard["panels"]:
        for inner in [panel, *panel.get("panels", ())]:
            out += [(inner["title"], target["expr"]) for target in inner.get("targets", ()) if target.get("expr")]
    return out


def metric_names(expr: str) -> set[str]:
    return set(METRIC.findall(expr))


def _digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def serve_config(prefix: str) -> dict:
    config = base_config(prefix)
    config["operator_key_sha256"] = [_digest(OPERATOR_KEY)]
    config["tenants"] = [
        {"id": "alpha", "key_sha256": [_digest(TENANT_KEYS["alpha"])], "adapters": "*"},
        {"id": "beta", "key_sha256": [_digest(TENANT_KEYS["beta"])], "adapters": ["json", "caps"]},
        {"id": "tight", "key_sha256": [_digest(TENANT_KEYS["tight"])], "requests_per_min": 3},
    ]
    return config


def start_prometheus(binary: str, directory: Path, target: str) -> tuple[subprocess.Popen, str]:
    (directory / "operator-key").write_text(OPERATOR_KEY)
    scrape = {"job_name": "loraplex", "metrics_path": "/metrics", "scrape_interval": f"{SCRAPE_INTERVAL_S}s",
              "authorization": {"type": "Bearer", "credentials_file": str(directory / "operator-key")},
              "static_configs": [{"targets": [target]}]}
    (directory / "prometheus.yml").write_text(yaml.safe_dump({"global": {"scrape_interval": f"{SCRAPE_INTERVAL_S}s"},
                                                              "scrape_configs": [scrape]}))
    port = _free_port()
    process = subprocess.Popen([binary, f"--config.file={directory / 'prometheus.yml'}", f"--storage.tsdb.path={directory / 'data'}",
                                f"--web.listen-address=127.0.0.1:{port}"],
                               stdout=subprocess.DEVNULL, stderr=open(directory / "prometheus.log", "w"))
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/-/ready", timeout=1).status_code == 200:
                return process, url
        except httpx.TransportError:
            pass
        if process.poll() is not None:
            break
        time.sleep(0.3)
    process.kill()
    raise RuntimeError("prometheus did not start:\n" + (directory / "prometheus.log").read_text()[-2000:])


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def load(url: str, seconds: float) -> dict[int, int]:
    """Requests from every tenant for `seconds`, and each kind of refusal; the count of each status."""
    statuses: dict[int, int] = {}
    prefixes = [f"Question {i}: describe the history of the {topic} in a few sentences. " * 3
                for i, topic in enumerate(("printing press", "telescope", "steam engine"))]
    rng = random.Random(0)

    async def send(client: httpx.AsyncClient, key: str, body: dict, path: str = "/v1/completions") -> None:
        try:
            if body.get("stream"):
                async with client.stream("POST", path, json=body, headers={"Authorization": f"Bearer {key}"}) as r:
                    async for _ in r.aiter_bytes():
                        pass
            else:
                r = await client.post(path, json=body, headers={"Authorization": f"Bearer {key}"})
            statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
        except httpx.HTTPError as e:
            print(f"  request failed: {e!r}", file=sys.stderr)

    async def user(client: httpx.AsyncClient, tenant: str, models: list[str]) -> None:
        while time.monotonic() < deadline:
            body = {"model": rng.choice(models), "prompt": rng.choice(prefixes) + rng.choice("abcdefgh"), "max_tokens": 8,
                    "ignore_eos": True, "stream": rng.random() < 0.5}
            await send(client, TENANT_KEYS[tenant], body)

    async def refusals(client: httpx.AsyncClient) -> None:
        while time.monotonic() < deadline:
            await send(client, "sk-not-a-key", {"model": "caps", "prompt": "hi"})  # 401
            await send(client, TENANT_KEYS["beta"], {"model": "verify", "prompt": "hi"})  # 404: not its adapter
            await send(client, TENANT_KEYS["alpha"], {"model": "caps", "prompt": "hi", "max_tokens": -3})  # 400
            await send(client, TENANT_KEYS["tight"], {"model": "caps", "prompt": "hi", "max_tokens": 2})  # 429 past 3/min
            await asyncio.sleep(1.0)

    deadline = time.monotonic() + seconds
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        await asyncio.gather(user(client, "alpha", ["caps", "signature", "smollm2-135m-instruct"]), user(client, "alpha", ["json"]),
                             user(client, "beta", ["json", "caps"]), refusals(client))
    return statuses


def has_data(prometheus: str, expr: str) -> tuple[bool, str]:
    """Whether `expr` (Grafana's variables filled in) returns a series with a number now, and what it returned."""
    for name, value in GRAFANA_VARIABLES.items():
        expr = expr.replace(name, value)
    answer = httpx.get(f"{prometheus}/api/v1/query", params={"query": expr}, timeout=30).json()
    if answer.get("status") != "success":
        return False, f"error: {answer.get('error')}"
    values = [float(r["value"][1]) for r in answer["data"]["result"]]
    finite = [v for v in values if math.isfinite(v)]
    return bool(finite), f"{len(values)} series" + (f", e.g. {finite[0]:.4g}" if finite else "")


def run(args: argparse.Namespace) -> int:
    binary = args.prometheus or shutil.which("prometheus")
    if binary is None:
        print("no prometheus binary (Debian: apt-get install prometheus)", file=sys.stderr)
        return 2
    queries = panel_queries(json.loads(DASHBOARD.read_text()))
    prefix = f"loraplex-dashboard-{uuid.uuid4().hex[:8]}"
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp)
        port = _free_port()
        print(f"starting loraplex serve on port {port} ...", flush=True)
        server = Server(serve_config(prefix), directory, port)
        prometheus = None
        try:
            prometheus, prometheus_url = start_prometheus(binary, directory, f"127.0.0.1:{port}")
            print(f"prometheus at {prometheus_url}; load for {args.seconds:g} s ...", flush=True)
            statuses = asyncio.run(load(server.url, args.seconds))
            print(f"answers by status: {dict(sorted(statuses.items()))}")
            time.sleep(3 * SCRAPE_INTERVAL_S)  # the last scrapes
            results = [(title, expr, *has_data(prometheus_url, expr)) for title, expr in queries]
        finally:
            if prometheus is not None:
                prometheus.terminate()
                prometheus.wait(30)
            server.stop()
            delete_keys(redis.Redis(), prefix)
    width = max(len(title) for title, *_ in results)
    for title, expr, is_data, what in results:
        print(f"{'ok     ' if is_data else 'NO DATA'}  {title:<{width}}  {what:<24}  {expr}")
    missing = [title for title, _, is_data, _ in results if not is_data]
    print(f"{len(results) - len(missing)}/{len(results)} queries return data" + (f"; none: {', '.join(missing)}" if missing else ""))
    return 1 if missing else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=40.0, help="how long to load the server")
    parser.add_argument("--prometheus", help="the prometheus binary (default: the one on PATH)")
    return run(parser.parse_args())


if __name__ == "__main__":
    sys.exit(main())
