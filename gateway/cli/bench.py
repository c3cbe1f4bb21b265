"""The `loraplex bench-*` commands: each measures one part (engine, prefill, structured output,
registry, serving, cluster, gateway, prefix cache); the benchmarks themselves live in bench/."""

from __future__ import annotations

import argparse

from cache.l2 import RedisConfig
from cache.prefix import PrefixCacheConfig
from gateway.cli.flags import Subparsers, device_flags, positive_int, token_ids
from worker.contract.spec import EngineConfig


def _workload_flags(p: argparse.ArgumentParser, *, adapters: int, rank: int, targets: str, prompt_tokens: int,
                    step_tokens: int, rounds_help: str) -> None:
    """The benchmark workload's flags (random adapters, concurrent requests), with each benchmark's defaults."""
    p.add_argument("--model", metavar="BASE.gguf", help="base model (default: SmolLM2-135M-Instruct)")
    p.add_argument("--adapters", type=positive_int, default=adapters, metavar="N",
                   help=f"random adapters to build (default {adapters})")
    p.add_argument("--rank", type=positive_int, default=rank)
    p.add_argument("--targets", choices=["qv", "attn", "all"], default=targets, help="qv: q,v; attn: q,k,v,o; all: the 7 linears")
    p.add_argument("--requests", type=positive_int, default=16, metavar="M", help="concurrent requests (default 16)")
    p.add_argument("--prompt-tokens", type=positive_int, default=prompt_tokens, metavar="P")
    p.add_argument("--max-tokens", type=positive_int, default=64, metavar="G")
    p.add_argument("--step-tokens", type=positive_int, default=step_tokens, metavar="N",
                   help="tokens per forward pass (prefill chunk budget)")
    p.add_argument("--rounds", type=positive_int, default=2, help=rounds_help)
    p.add_argument("--seed", type=int, default=0)


def add_engine(sub: Subparsers) -> None:
    p = sub.add_parser("bench-engine",
                       help="decode speed: one adapter vs mixed adapters vs llama.cpp's same-adapter batching")
    _workload_flags(p, adapters=16, rank=8, targets="attn", prompt_tokens=128, step_tokens=512,
                    rounds_help="rounds of the three runs, interleaved")
    p.add_argument("--registered", metavar="N,N,...", type=token_ids, default=None,
                   help="instead: mixed decode speed when the worker holds N adapters (the ones in use among them), "
                        "e.g. 16,256,1024")
    p.add_argument("--device-adapters", type=positive_int, default=None, metavar="M",
                   help="with one --registered N: serve N adapters from a device tier of M (the others on disk, or the "
                        "host with --host-bytes), against all N on the device, under Zipf traffic (bench/bench_tiers.py)")
    p.add_argument("--host-bytes", type=int, default=0, metavar="B", help="the host tier's budget with --device-adapters")
    p.add_argument("--no-memory-bound", action="store_true",
                   help="with --device-adapters: the tiers' reads on the default executor, no arena bound and no trim "
                        "(worker/residency/memory.py off), to compare the process's peak memory")
    p.add_argument("--dora", action="store_true",
                   help="instead: mixed decode speed of --adapters DoRA adapters against as many plain LoRAs of the "
                        "same rank and targets, in one worker (bench/bench_dora.py)")
    p.add_argument("--zipf", type=float, default=1.1, metavar="S", help="the traffic's Zipf exponent (default 1.1)")
    p.add_argument("--total-requests", type=positive_int, default=256, metavar="R",
                   help="requests per round with --device-adapters (default 256)")
    p.add_argument("--warmup", type=positive_int, default=256, metavar="W", help="warm-up requests (default 256)")
    p.add_argument("--speculative", choices=["ngram"], default=None,
                   help="instead: decode tokens/s with and without speculative decoding on the default model, on JSON "
                        "extraction (free, and under a JSON schema), a rewrite copying its prompt and free chat, one stream and "
                        "--streams (bench/bench_speculative.py)")
    p.add_argument("--max-draft", type=positive_int, default=4, metavar="K", help="drafts per step with --speculative (default 4)")
    p.add_argument("--streams", type=positive_int, default=16, metavar="S", help="concurrent streams with --speculative (default 16)")
    p.add_argument("--one-stream-requests", type=positive_int, default=4, metavar="R",
                   help="requests run one after another for the one-stream figure with --speculative (default 4)")
    device_flags(p)
    p.set_defaults(handler="bench.bench_engine:run")


def add_prefill(sub: Subparsers) -> None:
    p = sub.add_parser("bench-prefill",
                       help="prompt tokens/s at batch 1 and M, a long prompt, beside decoding, against the decode rate "
                            "and the linears alone")
    _workload_flags(p, adapters=8, rank=16, targets="all", prompt_tokens=82, step_tokens=EngineConfig.max_step_tokens,
                    rounds_help="rounds of the runs, interleaved (medians printed)")
    p.add_argument("--long-tokens", type=positive_int, default=1024, metavar="L",
                   help="the long prompt's tokens (default 1024)")
    device_flags(p)
    p.set_defaults(handler="bench.prefill:run")


def add_structured(sub: Subparsers) -> None:
    p = sub.add_parser("bench-structured",
                       help="decode speed of mixed-adapter requests with and without a JSON schema each")
    p.add_argument("--model", metavar="BASE.gguf", help="base model (default: SmolLM2-135M-Instruct)")
    p.add_argument("--requests", type=positive_int, default=16, metavar="M",
                   help="requests, each on its own random adapter")
    p.add_argument("--rank", type=positive_int, default=8)
    p.add_argument("--max-tokens", type=positive_int, default=64, metavar="G")
    p.add_argument("--rounds", type=positive_int, default=2, help="rounds of the two runs, interleaved")
    p.add_argument("--seed", type=int, default=0)
    device_flags(p)
    p.set_defaults(handler="bench.bench_structured:run")


def add_registry(sub: Subparsers) -> None:
    p = sub.add_parser("bench-registry",
                       help="time from uploading an adapter to a running server to its first served token")
    p.add_argument("--model", metavar="BASE.gguf", help="base model (default: SmolLM2-135M-Instruct)")
    p.add_argument("--adds", type=positive_int, default=20, metavar="N",
                   help="adapters to add, one after another (default 20)")
    p.add_argument("--rank", type=positive_int, default=16)
    p.add_argument("--targets", choices=["attn", "all"], default="all", help="attn: q,k,v,o; all: the 7 linears")
    p.add_argument("--port", type=int, default=8766, help="the server's port on loopback")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(handler="bench.registry_adds:run")


def add_serving(sub: Subparsers) -> None:
    p = sub.add_parser("bench-serving",
                       help="one workload through the engine alone and through loraplex serve: tokens/s, TTFT, gaps")
    _workload_flags(p, adapters=8, rank=16, targets="all", prompt_tokens=82, step_tokens=EngineConfig.max_step_tokens,
                    rounds_help="rounds of the two paths, interleaved (after one warm-up round)")
    p.add_argument("--modes", default="mixed,same", help="mixed: request i on adapter i %% N; same: all on adapter 0")
    p.add_argument("--stream", action=argparse.BooleanOptionalAction, default=True,
                   help="streamed /completion requests (default)")
    p.add_argument("--port", type=int, default=8765, help="the server's port on loopback")
    p.add_argument("--listener", choices=["gateway", "serve-proxy"], default="gateway",
                   help="the server's http.listener (default: gateway)")
    p.add_argument("--speculative", choices=["ngram"], default=None,
                   help="instead: chat completions through loraplex serve with and without speculative decoding "
                        "(the per-request switch), on bench-engine --speculative's three workloads, one stream and "
                        "--requests streams (bench/serving_speculative.py)")
    p.add_argument("--max-draft", type=positive_int, default=4, metavar="K", help="drafts per step with --speculative (default 4)")
    p.add_argument("--one-stream-requests", type=positive_int, default=4, metavar="R",
                   help="prompts asked one at a time for the one-stream figure with --speculative (default 4)")
    device_flags(p, "the engine-alone run's torch device (the server's comes from its config)")
    p.set_defaults(handler="bench.serving:run")


def add_cluster(sub: Subparsers) -> None:
    p = sub.add_parser("bench-cluster",
                       help="loraplex on 1, then 2 Ray worker nodes (network namespaces, a Redis Cluster, S3; root): req/s, "
                            "TTFT, prefix-cache hits across nodes, what a node's loss costs")
    p.add_argument("--duration", type=float, default=20.0, help="seconds of measured load a phase (default: 20)")
    p.add_argument("--warmup", type=float, default=8.0, help="seconds of load before each measurement (default: 8)")
    p.add_argument("--loss-window", type=float, default=30.0, help="seconds of load after the node is killed (default: 30)")
    p.add_argument("--concurrency", type=int, default=4, help="clients, each one request at a time (default: 4)")
    p.add_argument("--prefixes", type=int, default=8, help="shared prompt prefixes (default: 8)")
    p.add_argument("--max-tokens", type=int, default=16, help="tokens a request (default: 16)")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(handler="bench.cluster.bench:run")


def add_gateway(sub: Subparsers) -> None:
    p = sub.add_parser("bench-gateway",
                       help="latency and requests/s the gateway alone adds, against an instant stub shard")
    p.add_argument("--requests", type=positive_int, default=500,
                   help="sequential requests for the latency percentiles")
    p.add_argument("--concurrency", type=positive_int, default=32, help="requests in flight for the throughput run")
    p.add_argument("--seconds", type=float, default=5.0, help="length of the throughput run")
    p.add_argument("--tokens", type=positive_int, default=16, help="deltas the stub returns per request")
    p.set_defaults(handler="bench.bench_gateway:run")


def add_cache(sub: Subparsers) -> None:
    p = sub.add_parser("bench-cache", help="time to first token: prefix-cache miss vs Redis hit vs worker-memory hit")
    p.add_argument("--model", metavar="BASE.gguf", help="base model (default: SmolLM2-135M-Instruct)")
    p.add_argument("--redis", default=RedisConfig.url, metavar="URL")
    p.add_argument("--prompt-tokens", type=positive_int, default=1024, metavar="P")
    p.add_argument("--cached-tokens", type=positive_int, default=992, metavar="K", help="shared prefix (whole chunks)")
    p.add_argument("--chunk-tokens", type=positive_int, default=PrefixCacheConfig.chunk_tokens, metavar="C")
    p.add_argument("--step-tokens", type=positive_int, default=512, metavar="N",
                   help="tokens per forward pass (prefill chunk budget)")
    p.add_argument("--rounds", type=positive_int, default=5)
    p.add_argument("--seed", type=int, default=0)
    device_flags(p)
    p.set_defaults(handler="bench.bench_cache:run")
