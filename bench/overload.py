"""Overload: a noisy tenant floods a real `loraplex serve` with 4x its slots while a quiet
tenant keeps its pace; the quiet tenant's time to first token alone and beside the flood,
measured in interleaved rounds.

    python bench/overload.py [--rounds 2] [--seconds 40] [--port 8125]

Serves deploy/serve.yaml (two shards of one replica, 8 slots each: 16 slots) with a quiet
tenant and a noisy one without rate limits (only the queues and the scheduler's fairness
protect the quiet one). Each round runs the quiet tenant alone, then beside the noisy one's
64 concurrent streams (closed loop: each sends its next as the last ends), then alone again
is the next round. The quiet tenant streams one chat request every 2 s. Prints the quiet
tenant's TTFT p50/p90/p99 alone and beside the flood and their ratio, the noisy tenant's
statuses (429/503 carry Retry-After), and the longest any request waited for its first
token against the deadline; ends with `quiet_p99_ratio=` and `max_wait_s=`.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import sys
import tempfile
import time
import uuid
from collections import Counter
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.server import Server, base_config  # noqa: E402

KEYS = {"quiet": "sk-overload-quiet", "noisy": "sk-overload-noisy"}
DEADLINE_S = 60.0


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, int(round(q / 100 * len(ordered) + 0.5)) - 1))] if ordered else float("nan")


async def stream_ttft(client: httpx.AsyncClient, tenant: str, body: dict) -> tuple[int, float | None, bool]:
    started = time.monotonic()
    async with client.stream("POST", "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {KEYS[tenant]}"}) as r:
        first = None
        async for line in r.aiter_lines():
            if first is None and line.startswith("data: ") and '"content"' in line:
                first = time.monotonic() - started
        return r.status_code, first, "retry-after" in r.headers


async def phase(url: str, seconds: float, noisy: bool, quiet_ttft: list[float], statuses: Counter, waits: list[float]) -> None:
    until = time.monotonic() + seconds
    async with httpx.AsyncClient(base_url=url, timeout=DEADLINE_S + 30, limits=httpx.Limits(max_connections=200)) as client:
        async def quiet_loop() -> None:
            i = 0
            while time.monotonic() < until:
                body = {"model": "caps", "messages": [{"role": "user", "content": f"What is metal {i}?"}], "max_tokens": 16, "stream": True}
                task = asyncio.create_task(stream_ttft(client, "quiet", body))
                await asyncio.sleep(2.0)
                status, first, _ = await task
                statuses[f"quiet {status}"] += 1
                if first is not None:
                    quiet_ttft.append(first)
                    waits.append(first)
                i += 1

        async def noisy_user(u: int) -> None:
            i = 0
            while time.monotonic() < until:
                body = {"model": "caps", "messages": [{"role": "user", "content": f"Tell me a long story {u}-{i}."}], "max_tokens": 48,
                        "ignore_eos": True, "stream": True}
                status, first, retry_after = await stream_ttft(client, "noisy", body)
                statuses[f"noisy {status}{'' if status == 200 or retry_after else ' without Retry-After'}"] += 1
                if first is not None:
                    waits.append(first)
                if status != 200:
                    await asyncio.sleep(1.0)  # as told by Retry-After
                i += 1

        await asyncio.gather(quiet_loop(), *(noisy_user(u) for u in range(64 if noisy else 0)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=40.0)
    parser.add_argument("--port", type=int, default=8125)
    args = parser.parse_args()
    config = base_config(f"loraplex-overload-{uuid.uuid4().hex[:8]}")
    config["tenants"] = [{"id": t, "key_sha256": [hashlib.sha256(k.encode()).hexdigest()]} for t, k in KEYS.items()]
    config["http"] = {**config.get("http", {}), "request_timeout_s": DEADLINE_S}
    alone, beside, waits = [], [], []
    statuses: Counter = Counter()
    with tempfile.TemporaryDirectory() as tmp:
        print("starting loraplex serve...", file=sys.stderr)
        server = Server(config, Path(tmp), args.port)
        try:
            asyncio.run(phase(server.url, 10, False, [], Counter(), []))  # warm-up
            for round_index in range(args.rounds):
                for is_noisy, sink in ((False, alone), (True, beside)):
                    before = len(sink)
                    asyncio.run(phase(server.url, args.seconds, is_noisy, sink, statuses, waits))
                    got = sink[before:]
                    print(f"round {round_index + 1} {'beside the flood' if is_noisy else 'alone':16s} quiet TTFT p50 "
                          f"{percentile(got, 50) * 1e3:6.0f} ms p99 {percentile(got, 99) * 1e3:6.0f} ms ({len(got)})", file=sys.stderr)
        finally:
            server.stop()
    print(f"quiet tenant, {len(alone)} requests alone and {len(beside)} beside 64 noisy streams on 16 slots "
          f"({args.rounds} rounds of {args.seconds:g} s):")
    for name, values in (("alone", alone), ("beside", beside)):
        print(f"  {name:7s} TTFT p50 {percentile(values, 50) * 1e3:.0f} ms, p90 {percentile(values, 90) * 1e3:.0f} ms, "
              f"p99 {percentile(values, 99) * 1e3:.0f} ms")
    print(f"statuses: {dict(statuses)}")
    print(f"quiet_p99_ratio={percentile(beside, 99) / percentile(alone, 99):.2f}")
    print(f"quiet_p50_ratio={percentile(beside, 50) / percentile(alone, 50):.2f}")
    print(f"max_wait_s={max(waits, default=0.0):.1f} (deadline {DEADLINE_S:g} s)")


if __name__ == "__main__":
    main()
