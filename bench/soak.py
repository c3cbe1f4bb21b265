"""Soak: `loraplex serve` under a steady mix for minutes, loopback only, bounded.

    python bench/soak.py [--minutes 10] [--concurrency 6] [--port 8123]

Serves deploy/serve.yaml (two shards, four example adapters, tenants demo and acme; a
small worker-local cache, so it is full after the warm-up) and runs `--concurrency`
clients, each sending its next request as the last one ends: both tenants, every
endpoint, streamed or not, every adapter (stacked, the aLoRA after its invocation),
prompts from a fixed pool (so the caches reach their steady size in the warm-up), one
stream in ten abandoned after its first chunk, one request in twenty malformed. After a
one-minute warm-up it samples the resident memory of every process the server started
(the driver, Ray's processes, the replicas) each minute, and prints the status counts,
any 5xx, and each process's memory growth from the first sample to the last, ending
with `soak_5xx=`, `soak_requests=` and `soak_max_rss_growth_pct=`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
import uuid
from collections import Counter
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.server import Server, base_config  # noqa: E402

KEYS = {"demo": "sk-loraplex-demo", "acme": "sk-loraplex-acme"}
TOPICS = ["copper", "tin", "iron", "lead", "zinc", "gold", "silver", "nickel", "cobalt", "lithium"]
VERIFY = "<|im_start|>verify\n"


def request(rng: random.Random) -> tuple[str, str, dict, bool]:
    """(tenant, path, body, abandon): one request of the mix."""
    tenant = "acme" if rng.random() < 0.2 else "demo"
    topic = f"{rng.choice(TOPICS)} {rng.randrange(20)}"
    stream = rng.random() < 0.5
    if rng.random() < 0.05:
        return tenant, "/v1/completions", {"prompt": "x", "max_tokens": "many"}, False  # malformed: a 400
    adapters = ["json"] if tenant == "acme" else ["caps", "json", "signature", "base", "verify", "stacked"]
    adapter = rng.choice(adapters)
    max_tokens = rng.randrange(4, 33)
    if adapter == "verify":
        prompt = f"<|im_start|>user\nWhat is {topic}?<|im_end|>\n<|im_start|>assistant\nA metal.<|im_end|>\n{VERIFY}"
        return tenant, "/v1/completions", {"model": "verify", "prompt": prompt, "max_tokens": 8, "stream": stream}, False
    body: dict = {"max_tokens": max_tokens, "temperature": rng.choice([0.0, 0.8]), "stream": stream}
    if adapter == "stacked":
        body["lora"] = [{"name": "caps", "scale": 0.7}, {"name": "signature", "scale": 0.5}]
    elif adapter != "base":
        body["model"] = adapter
    kind = rng.choice(["chat", "completions", "completion"])
    if kind == "chat":
        return (
            tenant,
            "/v1/chat/completions",
            {**body, "messages": [{"role": "user", "content": f"Tell me about {topic}."}]},
            stream and rng.random() < 0.1,
        )
    if kind == "completions":
        return tenant, "/v1/completions", {**body, "prompt": f"A short note on {topic}:"}, stream and rng.random() < 0.1
    llama = {"prompt": f"A short note on {topic}:", "n_predict": max_tokens, "stream": stream, "lora": body.get("lora")}
    if tenant == "acme":
        llama["lora"] = [{"id": 0, "scale": 1.0}]
    return tenant, "/completion", {k: v for k, v in llama.items() if v is not None}, False


async def client(url: str, seed: int, until: float, statuses: Counter, errors: list[str]) -> None:
    rng = random.Random(seed)
    async with httpx.AsyncClient(base_url=url, timeout=300) as http:
        while time.monotonic() < until:
            tenant, path, body, abandon = request(rng)
            headers = {"Authorization": f"Bearer {KEYS[tenant]}"}
            try:
                if body.get("stream"):
                    async with http.stream("POST", path, json=body, headers=headers) as response:
                        status = response.status_code
                        async for line in response.aiter_lines():
                            if abandon:
                                break
                            if line.startswith("data: ") and '"error"' in line and status == 200:
                                errors.append(f"stream error event on {path}: {json.loads(line[6:])['error']}")
                                statuses["stream_error"] += 1
                        if status >= 500:
                            errors.append(f"{status} on {path}: {(await response.aread())[:200]!r}")
                else:
                    response = await http.post(path, json=body, headers=headers)
                    status = response.status_code
                    if status >= 500:
                        errors.append(f"{status} on {path}: {response.text[:200]}")
            except httpx.HTTPError as e:
                status = 0
                errors.append(f"no answer on {path}: {type(e).__name__}: {e}")
            statuses[status] += 1
            if status == 429:
                await asyncio.sleep(1.0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--warmup-s", type=float, default=60.0)
    parser.add_argument("--concurrency", type=int, default=6)
    parser.add_argument("--port", type=int, default=8123)
    args = parser.parse_args()
    config = base_config(f"loraplex-soak-{uuid.uuid4().hex[:8]}")
    config["cache"]["l1_bytes"] = 64 << 20  # full within the warm-up: growth after it is not the cache filling
    with tempfile.TemporaryDirectory() as tmp:
        print("starting loraplex serve...", file=sys.stderr)
        server = Server(config, Path(tmp), args.port)
        try:
            statuses: Counter = Counter()
            errors: list[str] = []
            samples: list[dict[int, tuple[str, int]]] = []
            started = time.monotonic()
            until = started + args.warmup_s + args.minutes * 60

            async def run() -> None:
                clients = [asyncio.create_task(client(server.url, seed, until, statuses, errors)) for seed in range(args.concurrency)]
                await asyncio.sleep(args.warmup_s)
                while time.monotonic() < until:
                    samples.append(server.rss_bytes())
                    print(f"  {(time.monotonic() - started) / 60:5.1f} min: {sum(statuses.values())} requests {dict(statuses)}",
                          file=sys.stderr)
                    await asyncio.sleep(min(60.0, max(until - time.monotonic(), 0)))
                await asyncio.gather(*clients)
                samples.append(server.rss_bytes())

            asyncio.run(run())
            elapsed = time.monotonic() - started - args.warmup_s
        finally:
            server.stop()
    first, last = samples[0], samples[-1]
    print(f"{sum(statuses.values())} requests in {args.minutes:g} min after a {args.warmup_s:g} s warm-up "
          f"({args.concurrency} clients): {dict(statuses)}")
    growth = []
    for pid, (command, rss) in sorted(first.items()):
        if pid in last and rss > 50 << 20:  # the processes that matter: the driver, the ingress, the replicas, Ray's
            pct = 100.0 * (last[pid][1] - rss) / rss
            growth.append(pct)
            series = " ".join(f"{s[pid][1] / 2**20:.0f}" for s in samples if pid in s)
            print(f"  pid {pid:>7} {rss / 2**20:8.1f} -> {last[pid][1] / 2**20:8.1f} MiB ({pct:+.1f}%)  {command[:60]}")
            print(f"           each minute (MiB): {series}")
    for e in errors[:10]:
        print(f"  error: {e}")
    print(f"soak_5xx={sum(n for s, n in statuses.items() if isinstance(s, int) and s >= 500) + statuses.get('stream_error', 0)}")
    print(f"soak_no_answer={statuses.get(0, 0)}")
    print(f"soak_requests={sum(statuses.values())}")
    print(f"soak_requests_per_s={sum(statuses.values()) / max(elapsed, 1e-9):.2f}")
    print(f"soak_max_rss_growth_pct={max(growth, default=0.0):.1f}")


if __name__ == "__main__":
    main()
