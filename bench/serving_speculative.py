"""`loraplex bench-serving --speculative ngram`: speculative decoding through `loraplex serve`, as a
client sees it, with and without, side by side in one run.

One server runs with `speculative: {method: ngram}`; a request that says `"speculative": 0` drafts
nothing (the per-request switch), so both ways share the server, its warm caches and the
machine's noise. The workloads are the engine bench's (bench/bench_speculative.py: JSON
extraction, free and under a JSON schema, a rewrite copying its prompt, free chat), greedy, as chat
completions:

- one stream: each prompt asked both ways in turn (the order alternating by round), and
- `--requests` streams: that many requests at once, all one way, then all the other.

Tokens/s is what the client gets: completion tokens over the wall time from sending to the last
byte (a stream's batch: from sending the first to the last answer), so HTTP, the gateway and Ray's
hops are in it; beside it, the answers' own decode rate (`timings.predicted_per_second`
averaged over tokens) and the acceptance (`draft_n_accepted` over `draft_n`). Greedy answers must
be the same both ways; the run says so and exits 1 when they are not.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path

import httpx

from bench.bench_speculative import WORKLOADS, prompts, response_format
from bench.cluster import free_port
from bench.server import Server
from worker.formats.default_model import resolve_model_path

START_TIMEOUT_S = 600.0
REQUEST_TIMEOUT_S = 600.0
MODES = ("off", "on")
OFF = {"speculative": 0}  # the per-request switch: this request drafts nothing


class Tally:
    """One workload, stream count and mode: client seconds, tokens, decode ms, drafts, answers."""

    def __init__(self) -> None:
        self.seconds = self.decode_ms = 0.0
        self.tokens = self.drafted = self.accepted = 0
        self.texts: list[str] = []

    def add_answer(self, answer: dict) -> None:
        timings = answer.get("timings", {})
        self.tokens += answer["usage"]["completion_tokens"]
        self.decode_ms += timings.get("predicted_ms", 0.0)
        self.drafted += timings.get("draft_n", 0)
        self.accepted += timings.get("draft_n_accepted", 0)
        self.texts.append(answer["choices"][0]["message"]["content"])

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    @property
    def decode_rate(self) -> float:
        return self.tokens / (self.decode_ms / 1e3) if self.decode_ms else 0.0


async def ask(client: httpx.AsyncClient, prompt: str, max_tokens: int, mode: str, workload: str = "chat") -> dict:
    body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0, **response_format(workload), **(OFF if mode == "off" else {})}
    answer = await client.post("/v1/chat/completions", json=body)
    answer.raise_for_status()
    return answer.json()


async def one_stream(client: httpx.AsyncClient, workload: str, texts: list[str], args: argparse.Namespace, rnd: int,
                     tallies: dict[str, Tally]) -> None:
    for prompt in texts:
        for mode in (MODES if rnd % 2 == 0 else MODES[::-1]):
            sent = time.perf_counter()
            answer = await ask(client, prompt, args.max_tokens, mode, workload)
            tallies[mode].seconds += time.perf_counter() - sent
            tallies[mode].add_answer(answer)


async def many_streams(client: httpx.AsyncClient, workload: str, texts: list[str], args: argparse.Namespace, rnd: int,
                       tallies: dict[str, Tally]) -> None:
    for mode in (MODES if rnd % 2 == 0 else MODES[::-1]):
        sent = time.perf_counter()
        answers = await asyncio.gather(*(ask(client, prompt, args.max_tokens, mode, workload) for prompt in texts))
        tallies[mode].seconds += time.perf_counter() - sent
        for answer in answers:
            tallies[mode].add_answer(answer)


async def measure(url: str, args: argparse.Namespace) -> list[tuple[str, int, dict[str, Tally]]]:
    rows = []
    limits = httpx.Limits(max_connections=args.requests * 2)
    async with httpx.AsyncClient(base_url=url, timeout=REQUEST_TIMEOUT_S, limits=limits) as client:
        await ask(client, "Hello", 8, "on")  # the first answer loads what it loads
        for workload in WORKLOADS:
            for streams in (1, args.requests):
                texts = prompts(workload, args.one_stream_requests if streams == 1 else streams)
                tallies = {mode: Tally() for mode in MODES}
                for rnd in range(args.rounds):
                    run = one_stream if streams == 1 else many_streams
                    await run(client, workload, texts, args, rnd, tallies)
                rows.append((workload, streams, tallies))
                off, on = tallies["off"], tallies["on"]
                print(f"{workload:5s} {streams:3d} streams: {off.rate:7.1f} -> {on.rate:7.1f} tokens/s "
                      f"({on.rate / off.rate:.2f}x)", file=sys.stderr)
    return rows


def server_config(args: argparse.Namespace, port: int) -> dict:
    settings = args.device_settings
    device = {"weights": settings.weights, "threads": settings.threads, "decode_threads": settings.decode_threads}
    return {"model": str(resolve_model_path(args.model)), "adapters": [],
            "shards": [{"name": "base", "adapters": [], "replicas": 1}],
            "engine": {"num_seq_slots": max(args.requests, 1)}, "device": device,
            "cache": {"redis_url": None}, "state": {"ephemeral": True}, "auth": "none",
            "speculative": {"method": args.speculative, "max_draft": args.max_draft},
            "http": {"host": "127.0.0.1", "port": port}}


def report(rows: list[tuple[str, int, dict[str, Tally]]], args: argparse.Namespace) -> bool:
    print(f"loraplex serve, speculative {args.speculative} max_draft {args.max_draft}, weights {args.device_settings.weights}; "
          f"greedy chat completions of up to {args.max_tokens} tokens, {args.rounds} rounds, both ways interleaved")
    print(f"{'workload':8s} {'streams':>7s} {'off tok/s':>10s} {'on tok/s':>10s} {'speedup':>8s} "
          f"{'decode off':>10s} {'decode on':>10s} {'accepted':>9s} {'drafts':>7s} same")
    all_same = True
    for workload, streams, tallies in rows:
        off, on = tallies["off"], tallies["on"]
        same = off.texts == on.texts
        all_same = all_same and same
        acceptance = on.accepted / on.drafted if on.drafted else 0.0
        print(f"{workload:8s} {streams:7d} {off.rate:10.1f} {on.rate:10.1f} {on.rate / off.rate:7.2f}x "
              f"{off.decode_rate:10.1f} {on.decode_rate:10.1f} {acceptance:9.2f} {on.drafted:7d} {'yes' if same else 'NO'}")
    return all_same


def run(args: argparse.Namespace) -> int:
    port = args.port or free_port()
    server = Server(server_config(args, port), Path(tempfile.mkdtemp(prefix="bench-spec-serving-")), port, START_TIMEOUT_S)
    try:
        rows = asyncio.run(measure(server.url, args))
    finally:
        server.stop(60)
    return 0 if report(rows, args) else 1
