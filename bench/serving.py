"""`loraplex bench-serving`: one workload through the engine alone and through `loraplex serve`
on loopback, interleaved round by round, so machine noise hits both alike.

The workload: N random adapters (rank r, on every linear), R concurrent requests of P random
prompt tokens and M new tokens each (`ignore_eos`), `mixed` (request i uses adapter i % N) and
`same` (all use adapter 0). Through HTTP: streamed (or not) `/completion` requests, all sent at
once by an asyncio client; one shard replica holding the adapters; Redis on when it answers.

Printed per configuration: tokens/s of each path and their ratio, time to first token p50/p90,
and the inter-token gap p50/p99 (a streamed token's arrival after the previous one of its
request; tokens that arrive together count 0), next to the engine's own decode step time; and the
mean time of the server's passes that only decode (its /metrics), against the engine alone's.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import sys
import tempfile
import time
import uuid
from pathlib import Path

import httpx
import numpy as np
import redis
from prometheus_client.parser import text_string_to_metric_families

from bench.engine_common import write_random_adapters
from bench.server import Server, delete_keys
from worker.contract.params import SamplingParams
from worker.contract.spec import EngineConfig
from worker.engine.engine import Engine, EngineRequest
from worker.engine.runner import ModelRunner
from worker.formats.default_model import resolve_model_path
from worker.formats.gguf_file import GGUFFile
from worker.formats.hparams import ModelHParams
from worker.model.device import DeviceConfig

REDIS_URL = "redis://127.0.0.1:6379/0"


def prompts(args: argparse.Namespace, vocab: int, round_index: int) -> list[list[int]]:
    """Fresh random prompts each round (no prefix-cache hits), the same for both paths."""
    rng = np.random.default_rng(args.seed + round_index)
    return [rng.integers(100, vocab, args.prompt_tokens).tolist() for _ in range(args.requests)]


def adapter_of(i: int, mode: str, num_adapters: int) -> int:
    return i % num_adapters if mode == "mixed" else 0


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def run_engine(engine: Engine, batch: list[list[int]], args: argparse.Namespace, mode: str) -> dict[str, float]:
    """The requests together in the engine, step by step: wall time, TTFTs, gaps, step times."""
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    started = time.perf_counter()
    for i, prompt in enumerate(batch):
        engine.add_request(EngineRequest(f"r{i}", prompt, params, {adapter_of(i, mode, args.adapters): 1.0}), arrived_s=started)
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    gaps, steps, tokens = [], [], 0
    while engine.has_work():
        before = time.perf_counter()
        outputs = engine.step()
        now = time.perf_counter()
        decoding = all(o.request_id in first for o in outputs)
        if decoding and outputs:
            steps.append(now - before)
        for o in outputs:
            tokens += len(o.token_ids)
            if o.request_id in last:
                gaps.append(now - last[o.request_id])
            first.setdefault(o.request_id, now - started)
            last[o.request_id] = now
    wall = time.perf_counter() - started
    return {
        "tokens_per_s": tokens / wall,
        "ttft": list(first.values()),
        "gaps": gaps,
        "step_s": float(np.median(steps)) if steps else float("nan"),
    }


async def run_http(url: str, batch: list[list[int]], args: argparse.Namespace, mode: str) -> dict[str, float]:
    async def one(client: httpx.AsyncClient, i: int, prompt: list[int]) -> tuple[int, float | None, list[float]]:
        body = {"prompt": prompt, "n_predict": args.max_tokens, "temperature": 0, "ignore_eos": True, "stream": args.stream,
                "lora": [{"name": f"a{adapter_of(i, mode, args.adapters)}", "scale": 1.0}]}
        sent = time.perf_counter()
        if not args.stream:
            r = await client.post("/completion", json=body)
            r.raise_for_status()
            return r.json()["tokens_predicted"], time.perf_counter() - sent, []
        arrivals: list[float] = []
        async with client.stream("POST", "/completion", json=body) as r:
            r.raise_for_status()
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    event = json.loads(line[6:])
                    arrivals += [time.perf_counter()] * len(event.get("tokens", []))
        return len(arrivals), (arrivals[0] - sent) if arrivals else None, arrivals

    async with httpx.AsyncClient(base_url=url, timeout=600, limits=httpx.Limits(max_connections=args.requests * 2)) as client:
        started = time.perf_counter()
        results = await asyncio.gather(*(one(client, i, p) for i, p in enumerate(batch)))
        wall = time.perf_counter() - started
    gaps = [b - a for _, _, arrivals in results for a, b in itertools.pairwise(arrivals)]
    return {"tokens_per_s": sum(n for n, _, _ in results) / wall, "ttft": [t for _, t, _ in results if t is not None], "gaps": gaps}


def decode_steps(url: str) -> tuple[float, int]:
    """The server's engine time in passes that only decode, and their number (its /metrics)."""
    families = text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=60).text)
    samples = next((f.samples for f in families if f.name == "loraplex_engine_decode_step_seconds"), [])
    return sum(s.value for s in samples if s.name.endswith("_sum")), int(sum(s.value for s in samples if s.name.endswith("_count")))


def serve_config(model_path: Path, adapters: list[Path], args: argparse.Namespace) -> dict:
    return {
        "model": str(model_path), "model_name": "bench",
        "adapters": [{"name": f"a{i}", "path": str(p)} for i, p in enumerate(adapters)],
        "shards": [{"name": "all", "adapters": [f"a{i}" for i in range(len(adapters))], "replicas": 1}],
        "cache": {"redis_url": REDIS_URL, "key_prefix": f"loraplex-bench-{uuid.uuid4().hex[:8]}", "chunk_tokens": 32},
        "engine": {"num_seq_slots": args.requests, "max_step_tokens": args.step_tokens},
        "device": {"threads": args.device_settings.threads, "decode_threads": args.device_settings.decode_threads},
        "http": {"max_tokens_default": args.max_tokens, "listener": args.listener},
        "auth": "none", "state": {"ephemeral": True},  # a benchmark on this machine: no keys, state in its Redis
    }


def summarize(name: str, engine: list[dict], http: list[dict]) -> None:
    e_rate, h_rate = np.mean([r["tokens_per_s"] for r in engine]), np.mean([r["tokens_per_s"] for r in http])
    e_ttft, h_ttft = [t for r in engine for t in r["ttft"]], [t for r in http for t in r["ttft"]]
    e_gaps, h_gaps = [g for r in engine for g in r["gaps"]], [g for r in http for g in r["gaps"]]
    step = float(np.median([r["step_s"] for r in engine]))
    print(f"{name:6s} engine {e_rate:6.1f} tok/s   http {h_rate:6.1f} tok/s   ratio {h_rate / e_rate:4.2f}")
    print(f"       TTFT p50/p90   engine {percentile(e_ttft, 50) * 1e3:6.0f}/{percentile(e_ttft, 90) * 1e3:6.0f} ms   "
          f"http {percentile(h_ttft, 50) * 1e3:6.0f}/{percentile(h_ttft, 90) * 1e3:6.0f} ms")
    if h_gaps:
        print(f"       gap p50/p99    engine {percentile(e_gaps, 50) * 1e3:6.0f}/{percentile(e_gaps, 99) * 1e3:6.0f} ms   "
              f"http {percentile(h_gaps, 50) * 1e3:6.0f}/{percentile(h_gaps, 99) * 1e3:6.0f} ms   "
              f"(engine decode step {step * 1e3:.0f} ms; http p99 / step {percentile(h_gaps, 99) / step:.1f}x)")
    server_step = float(np.mean([r["server_step_s"] for r in http]))
    print(f"       decode-only pass in the server {server_step * 1e3:6.0f} ms (mean; the engine alone: {step * 1e3:.0f} ms, median)")
    sys.stdout.flush()


def run(args: argparse.Namespace) -> int:
    if getattr(args, "speculative", None):
        from bench import serving_speculative

        return serving_speculative.run(args)
    model_path = Path(resolve_model_path(args.model))
    base = GGUFFile(model_path)
    vocab = ModelHParams.from_gguf(base).vocab_size
    with tempfile.TemporaryDirectory() as tmp:
        adapters = write_random_adapters(base, Path(tmp), args.adapters, args.rank, args.targets, args.seed)
        config = serve_config(model_path, adapters, args)
        server = Server(config, Path(tmp), args.port)
        try:
            device = DeviceConfig.of(args.device_settings)
            device.apply_to_process()
            runner = ModelRunner.from_paths(model_path, adapters, device)
            slot_len = args.prompt_tokens + args.max_tokens
            print(f"{args.requests} requests x ({args.prompt_tokens} prompt + {args.max_tokens} new tokens), "
                  f"{args.adapters} adapters of rank "
                  f"{args.rank} on {args.targets} linears, {'streamed' if args.stream else 'not streamed'}, {args.rounds} rounds each, "
                  f"http.listener {args.listener}")
            for mode in args.modes.split(","):
                engine_runs, http_runs = [], []
                for r in range(args.rounds + 1):  # round 0 warms both paths up and is not counted
                    batch = prompts(args, vocab, r * 7 + len(mode))
                    engine = Engine(
                        runner, None, EngineConfig(num_seq_slots=args.requests, slot_len=slot_len, max_step_tokens=args.step_tokens)
                    )
                    e = run_engine(engine, batch, args, mode)
                    steps_before = decode_steps(server.url)
                    h = asyncio.run(run_http(server.url, prompts(args, vocab, r * 7 + len(mode) + 1000), args, mode))
                    steps_after = decode_steps(server.url)
                    passes = steps_after[1] - steps_before[1]
                    h["server_step_s"] = (steps_after[0] - steps_before[0]) / passes if passes else float("nan")
                    if r:
                        engine_runs.append(e)
                        http_runs.append(h)
                summarize(mode, engine_runs, http_runs)
        finally:
            server.stop()
            try:
                delete_keys(redis.Redis.from_url(REDIS_URL), config["cache"]["key_prefix"])
            except redis.ConnectionError:  # no Redis: nothing was stored
                pass
    return 0
