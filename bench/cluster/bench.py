"""`loraplex bench-cluster`: loraplex on the multi-node topology (topology.py: Ray nodes on hosts of
their own, a Redis Cluster, moto's S3), in one run:

1. one worker node, a shard of one replica: steady load, requests/s and TTFT p50/p99;
2. a second worker node joins, a shard of two replicas (one a node): the same load, and the
   ratios to (1); the prefix-cache hits across nodes: requests served on another node than the
   one that first computed their shared prefix, and how much of it they found in Redis;
3. one of the two worker nodes SIGKILLed under the same load: what it cost (requests failed,
   the longest wait for an answer, requests/s after against before).

The load: `--concurrency` clients, each sending completions one after another, streamed and whole
in turn, each prompt one of `--prefixes` shared prefixes of 96 tokens and a suffix of its own, on
the real default model (SmolLM2-135M). Every host is on this one machine: its cores are shared by
every node, so a second node brings no more compute here; the ratio shows what spreading costs or
saves (routing, Redis round trips), not a cluster's scaling. Needs root (network namespaces).
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import statistics
import threading
import time
from dataclasses import dataclass, field

import httpx

from bench.cluster import free_port
from bench.cluster.topology import Topology

INGRESS_LABEL = "loraplex.io/ingress"
KEY, OPERATOR_KEY = "sk-bench-cluster", "sk-bench-operator"
PREFIX_TOKENS, SUFFIX_TOKENS = 96, 15  # 3 cache chunks of 32 shared; the last prompt token is always computed
MODEL_NAME = "smollm2-135m-instruct"


@dataclass
class Outcome:
    started: float
    ended: float
    ok: bool
    streamed: bool
    ttft_s: float | None = None
    replica: str = ""
    prefix: int = 0
    cached_tokens: int = 0


@dataclass
class Load:
    """`concurrency` clients until stopped; every outcome kept."""

    url: str
    concurrency: int
    max_tokens: int
    prefixes: list[list[int]]
    outcomes: list[Outcome] = field(default_factory=list)
    seed: int = 0

    def __post_init__(self) -> None:
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._client, args=(i,), daemon=True) for i in range(self.concurrency)]

    def __enter__(self) -> Load:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(120)

    def _client(self, i: int) -> None:
        rng = random.Random(self.seed * 1000 + i)
        headers = {"Authorization": f"Bearer {KEY}"}
        with httpx.Client(timeout=90, headers=headers) as client:
            n = 0
            while not self._stop.is_set():
                k = rng.randrange(len(self.prefixes))
                prompt = self.prefixes[k] + [rng.randrange(1000, 20000) for _ in range(SUFFIX_TOKENS)]
                streamed = (i + n) % 2 == 0
                n += 1
                self.outcomes.append(ask(client, self.url, prompt, self.max_tokens, streamed, k))


def ask(client: httpx.Client, url: str, prompt: list[int], max_tokens: int, streamed: bool, prefix: int) -> Outcome:
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": streamed}
    if streamed:
        body["stream_options"] = {"include_usage": True}
    started = time.monotonic()
    outcome = Outcome(started, started, False, streamed, prefix=prefix)
    try:
        if not streamed:
            r = client.post(f"{url}/v1/completions", json=body)
            outcome.ok = r.status_code == 200
            if outcome.ok:
                outcome.cached_tokens = r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
            outcome.replica = r.headers.get("x-loraplex-replica", "")
        else:
            with client.stream("POST", f"{url}/v1/completions", json=body) as r:
                outcome.replica = r.headers.get("x-loraplex-replica", "")
                done = False
                for line in r.iter_lines():
                    if not line.startswith("data: "):
                        continue
                    data = line[6:]
                    if data == "[DONE]":
                        done = True
                        break
                    event = json.loads(data)
                    if "error" in event:
                        break
                    if outcome.ttft_s is None and event.get("choices") and event["choices"][0].get("text"):
                        outcome.ttft_s = time.monotonic() - started
                    if event.get("usage"):
                        outcome.cached_tokens = event["usage"]["prompt_tokens_details"]["cached_tokens"]
                outcome.ok = r.status_code == 200 and done
    except httpx.HTTPError:
        outcome.ok = False
    outcome.ended = time.monotonic()
    return outcome


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def summary(outcomes: list[Outcome], duration_s: float) -> dict[str, float]:
    ttfts = [o.ttft_s for o in outcomes if o.ok and o.ttft_s is not None]
    return {"requests": len(outcomes), "failed": sum(not o.ok for o in outcomes),
            "req_per_s": sum(o.ok for o in outcomes) / duration_s,
            "ttft_p50_ms": 1e3 * percentile(ttfts, 0.5), "ttft_p99_ms": 1e3 * percentile(ttfts, 0.99)}


def cross_node_hits(outcomes: list[Outcome]) -> dict[str, float]:
    """Requests served on another replica (node) than the one that first answered their prefix, once
    that answer was in: how many, and how many found the whole shared prefix in the cache."""
    home: dict[int, tuple[str, float]] = {}
    for o in sorted((o for o in outcomes if o.ok), key=lambda o: o.ended):
        home.setdefault(o.prefix, (o.replica, o.ended))
    away = [o for o in outcomes if o.ok and o.prefix in home and o.replica != home[o.prefix][0] and o.started > home[o.prefix][1]]
    hits = [o for o in away if o.cached_tokens >= PREFIX_TOKENS]
    return {"requests": len(away), "hits": len(hits), "hit_rate": len(hits) / len(away) if away else float("nan"),
            "mean_cached_tokens": statistics.fmean(o.cached_tokens for o in away) if away else float("nan")}


def node_loss(outcomes: list[Outcome], killed_at: float, before_s: float, after_s: float) -> dict[str, float]:
    before = [o for o in outcomes if killed_at - before_s <= o.ended < killed_at]
    after = [o for o in outcomes if killed_at <= o.ended < killed_at + after_s]
    hit = [o for o in outcomes if o.started < killed_at < o.ended or o.started >= killed_at]
    ends = sorted(o.ended for o in outcomes if o.ok and o.ended >= killed_at)
    gaps = [b - a for a, b in zip([killed_at, *ends], ends)]
    return {"requests_after": len(hit), "failed_whole": sum(not o.ok and not o.streamed for o in hit),
            "failed_streams": sum(not o.ok and o.streamed for o in hit),
            "longest_wait_s": max(gaps, default=float("nan")),
            "slowest_request_s": max((o.ended - o.started for o in hit), default=float("nan")),
            "req_per_s_before": sum(o.ok for o in before) / before_s, "req_per_s_after": sum(o.ok for o in after) / after_s}


def config(topology: Topology, replicas: int, args) -> dict:
    return topology.config(
        None, MODEL_NAME,
        shards=[{"name": "s", "adapters": [], "replicas": replicas, "num_cpus": 2}],  # one replica a worker node
        tenants=[{"id": "bench", "key_sha256": [hashlib.sha256(KEY.encode()).hexdigest()]}],
        operator_key_sha256=[hashlib.sha256(OPERATOR_KEY.encode()).hexdigest()],
        engine={"num_seq_slots": 8},
        http={"host": "0.0.0.0", "port": free_port(), "request_timeout_s": 60, "node_labels": {INGRESS_LABEL: "yes"}},
    )


def measure(url: str, args, prefixes: list[list[int]], seed: int) -> tuple[list[Outcome], float]:
    with Load(url, args.concurrency, args.max_tokens, prefixes, seed=seed + 100) as warm:  # each prefix computed once, code paths warm
        time.sleep(args.warmup)
    del warm
    started = time.monotonic()
    with Load(url, args.concurrency, args.max_tokens, prefixes, seed=seed) as load:
        time.sleep(args.duration)
    return load.outcomes, time.monotonic() - started


def run(args) -> int:
    rng = random.Random(args.seed)
    prefixes = [[rng.randrange(1000, 20000) for _ in range(PREFIX_TOKENS)] for _ in range(args.prefixes)]
    print(f"bench-cluster: {args.concurrency} clients, {args.prefixes} shared prefixes of {PREFIX_TOKENS} tokens, "
          f"max_tokens {args.max_tokens}, {args.duration:g} s a phase; starting the topology...", flush=True)
    topology = Topology(head_cpus=1, head_labels=f"{INGRESS_LABEL}=yes")
    try:
        topology.add_worker("n1", num_cpus=2)
        with topology.serving(config(topology, 1, args)) as serving:
            one, one_s = measure(serving.url, args, prefixes, seed=1)
        one_node = summary(one, one_s)
        print(f"1 worker node:  {fmt(one_node)}", flush=True)
        topology.add_worker("n2", num_cpus=2)
        with topology.serving(config(topology, 2, args)) as serving:
            two, two_s = measure(serving.url, args, prefixes, seed=2)
            two_nodes, across = summary(two, two_s), cross_node_hits(two)
            print(f"2 worker nodes: {fmt(two_nodes)}", flush=True)
            victim = topology.hosts[0]
            with Load(serving.url, args.concurrency, args.max_tokens, prefixes, seed=3) as load:
                time.sleep(args.duration / 2)
                killed_at = time.monotonic()
                topology.network.kill(victim)
                time.sleep(args.loss_window)
            loss = node_loss(load.outcomes, killed_at, args.duration / 2, args.loss_window)
    finally:
        topology.close()
    def ratio(key: str) -> float:
        return two_nodes[key] / one_node[key] if one_node[key] else float("nan")

    print()
    print(f"2 nodes / 1 node: requests/s x{ratio('req_per_s'):.2f}, TTFT p50 x{ratio('ttft_p50_ms'):.2f}, "
          f"p99 x{ratio('ttft_p99_ms'):.2f} (every node on this machine's {os.cpu_count()} cores: no more compute with 2)")
    print(f"prefix cache across nodes: {across['requests']} requests on another node than their prefix's first, "
          f"{across['hits']} found the whole prefix in Redis (hit rate {across['hit_rate']:.2f}, "
          f"mean {across['mean_cached_tokens']:.0f} of {PREFIX_TOKENS} tokens)")
    print(f"a worker node SIGKILLed: {loss['requests_after']} requests in flight or sent after, "
          f"{loss['failed_whole']} whole failed, {loss['failed_streams']} streams failed; longest wait for an answer "
          f"{loss['longest_wait_s']:.1f} s, slowest request {loss['slowest_request_s']:.1f} s; requests/s "
          f"{loss['req_per_s_before']:.2f} before, {loss['req_per_s_after']:.2f} in the {args.loss_window:g} s after")
    return 0


def fmt(s: dict[str, float]) -> str:
    return (f"{s['req_per_s']:.2f} req/s, TTFT p50 {s['ttft_p50_ms']:.0f} ms p99 {s['ttft_p99_ms']:.0f} ms "
            f"({s['requests']} requests, {s['failed']} failed)")
