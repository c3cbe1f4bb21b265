"""`loraplex bench-gateway`: what the gateway alone adds, against an instant stub shard.

The gateway (auth, parsing, tokenizing, rate limiting, routing, formatting,
metrics; the default config's catalog) runs under uvicorn in its own process
over a stub pool whose replicas answer every request at once with
`--tokens` deltas; a client in this process sends OpenAI completions requests
over HTTP. Reported: latency p50/p99 one request at a time (the stub takes no
time, so this is the gateway's added latency plus the loopback HTTP round
trip), and the most requests/s with `--concurrency` requests in flight.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import statistics
import sys
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx

from gateway.cluster.pool import replica_infos
from gateway.config import load_config, parse_config
from worker.contract.calls import Delta, Usage, WorkerCall

KEY = "sk-bench"


class StubPool:
    """Replicas that answer at once: `max_tokens` deltas of one token each."""

    def __init__(self, config) -> None:
        self.replicas = replica_infos(config)

    async def stream(self, replica_id: str, call: WorkerCall) -> AsyncIterator[Delta]:
        n = max(call.params.max_tokens, 1)
        for _ in range(n - 1):
            yield Delta((42,), " x")
        yield Delta((42,), " x", finish_reason="length", usage=Usage(len(call.prompt_ids), n, 0))

    async def health(self, replica_id: str) -> dict[str, Any]:
        return {"pid": os.getpid(), "cache": {"redis": "off"}}

    async def metrics(self, replica_id: str) -> str:
        return ""


def bench_config():
    import hashlib

    data = load_config().model_dump()
    data["tenants"] = [{"id": "bench", "key_sha256": [hashlib.sha256(KEY.encode()).hexdigest()]}]
    data["cache"]["redis_url"] = None
    return parse_config(data, data.pop("base_dir"))


def serve_stub(port: int) -> None:
    import logging

    import uvicorn

    from gateway.api.app import create_app
    from gateway.catalog import Catalog
    from gateway.compose import Gateway

    logging.disable(logging.WARNING)
    config = bench_config()
    app = create_app()
    app.state.gateway = Gateway(config, Catalog(config), StubPool(config))
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="error", access_log=False)


async def measure(url: str, args: argparse.Namespace) -> dict[str, float]:
    body = {"model": "caps", "prompt": "Tell me about copper and its uses in electrical wiring. " * 8, "max_tokens": args.tokens}
    headers = {"Authorization": f"Bearer {KEY}"}
    async with httpx.AsyncClient(
        base_url=url, headers=headers, timeout=30, limits=httpx.Limits(max_connections=args.concurrency)
    ) as client:
        for _ in range(50):  # warm-up
            (await client.post("/v1/completions", json=body)).raise_for_status()
        latencies = []
        for _ in range(args.requests):
            started = time.perf_counter()
            (await client.post("/v1/completions", json=body)).raise_for_status()
            latencies.append(time.perf_counter() - started)
        done = 0
        deadline = time.perf_counter() + args.seconds

        async def user() -> None:
            nonlocal done
            while time.perf_counter() < deadline:
                (await client.post("/v1/completions", json=body)).raise_for_status()
                done += 1

        started = time.perf_counter()
        await asyncio.gather(*(user() for _ in range(args.concurrency)))
        elapsed = time.perf_counter() - started
    latencies.sort()
    return {
        "p50_ms": statistics.median(latencies) * 1e3,
        "p99_ms": latencies[int(0.99 * (len(latencies) - 1))] * 1e3,
        "rps": done / elapsed,
    }


def run(args: argparse.Namespace) -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = multiprocessing.get_context("spawn").Process(target=serve_stub, args=(port,), daemon=True)
    server.start()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline or not server.is_alive():
            print("loraplex bench-gateway: the stub gateway did not start", file=sys.stderr)
            return 1
        time.sleep(0.2)
    try:
        result = asyncio.run(measure(url, args))
    finally:
        server.terminate()
        server.join(10)
    print(f"gateway over an instant stub shard (uvicorn, 1 process; client on the same {os.cpu_count()}-core machine); "
          f"completions with a {len('Tell me about copper and its uses in electrical wiring. ' * 8)}-character prompt, "
          f"{args.tokens} tokens")
    print(f"one at a time: p50 {result['p50_ms']:.2f} ms, p99 {result['p99_ms']:.2f} ms over {args.requests} requests")
    print(f"{args.concurrency} in flight for {args.seconds:g} s: {result['rps']:.0f} requests/s")
    print(f"gateway_p50_ms={result['p50_ms']:.2f}")
    print(f"gateway_p99_ms={result['p99_ms']:.2f}")
    print(f"gateway_max_rps={result['rps']:.0f}")
    return 0
