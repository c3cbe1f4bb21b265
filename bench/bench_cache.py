"""`loraplex bench-cache`: time to first token with the prefix cache missing, hit in
Redis (L2) and hit in the worker (L1), measured side by side.

Every round builds a fresh shared prefix (`--cached-tokens`, whole chunks) and
runs four 1-token requests, each prompt = prefix + its own suffix, up to
`--prompt-tokens` (the suffix is never cached):
- off: an engine without a prefix cache (the baseline a miss pays on top of);
- miss: a fresh tenant salt, so nothing is found; its chunks are stored;
- l2: a new worker (empty L1, its own Redis connection) with that salt: the
  prefix comes from Redis in one MGET;
- l1: the same worker again: the prefix comes from its own memory.
TTFT is arrival (before the lookup) to the first token. Ratios are of medians.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from bench.server import delete_keys
from cache.l2 import RedisConfig
from cache.prefix import PrefixCache, PrefixCacheConfig
from worker.contract.params import SamplingParams
from worker.contract.spec import EngineConfig
from worker.engine.engine import Engine, EngineRequest
from worker.engine.prefix_kv import open_prefix_cache
from worker.engine.runner import ModelRunner
from worker.formats.default_model import resolve_model_path
from worker.model.device import DeviceConfig

MODES = ("off", "miss", "l2", "l1")


def ttft(runner: ModelRunner, cache: PrefixCache | None, prompt: list[int], salt: str, step_tokens: int) -> tuple[float, int]:
    engine = Engine(runner, None, EngineConfig(num_seq_slots=1, slot_len=len(prompt) + 1, max_step_tokens=step_tokens), prefix_cache=cache)
    result = engine.run_all([EngineRequest("b", prompt, SamplingParams(max_tokens=1, temperature=0), cache_salt=salt)])["b"]
    if result.finish_reason == "error":
        raise RuntimeError(result.error)
    return result.prompt_time_s, result.cached_tokens


@dataclass
class Measured:
    times: dict[str, list[float]] = field(default_factory=lambda: {m: [] for m in MODES})  # mode -> TTFT per round
    bytes_per_token: list[float] = field(default_factory=list)  # l2: bytes read from Redis per cached token
    trips: dict[str, list[int]] = field(default_factory=lambda: {m: [] for m in ("miss", "l2", "l1")})  # Redis round trips


def measure(args: argparse.Namespace, runner: ModelRunner, cache_config: PrefixCacheConfig) -> Measured | None:
    """`args.rounds` rounds of the four modes (after one that warms up); None when a mode found
    another number of cached tokens than it should."""
    vocab = runner.hparams.vocab_size
    rng = np.random.default_rng(args.seed)
    suffix_len = args.prompt_tokens - args.cached_tokens
    measured = Measured()
    writer = open_prefix_cache(runner, cache_config)
    ttft(runner, None, rng.integers(0, vocab, args.prompt_tokens).tolist(), "", args.step_tokens)  # warm-up
    for round_index in range(args.rounds + 1):
        prefix = rng.integers(0, vocab, args.cached_tokens).tolist()
        prompts = {m: prefix + rng.integers(0, vocab, suffix_len).tolist() for m in MODES}
        salt = uuid.uuid4().hex
        reader = open_prefix_cache(runner, cache_config)  # a worker that has never seen this prefix
        got = {"off": ttft(runner, None, prompts["off"], salt, args.step_tokens)}
        for mode, cache in (("miss", writer), ("l2", reader), ("l1", reader)):
            before_trips, before_bytes = cache.tier.num_round_trips, cache.stats.num_bytes_read_l2
            got[mode] = ttft(runner, cache, prompts[mode], salt, args.step_tokens)
            cache.flush()
            measured.trips[mode].append(cache.tier.num_round_trips - before_trips)
            if mode == "l2":
                measured.bytes_per_token.append((cache.stats.num_bytes_read_l2 - before_bytes) / max(got[mode][1], 1))
        reader.close()
        expected = {"off": 0, "miss": 0, "l2": args.cached_tokens, "l1": args.cached_tokens}
        if any(got[m][1] != expected[m] for m in MODES):
            print(f"loraplex bench-cache: unexpected cached_tokens {({m: got[m][1] for m in MODES})}", file=sys.stderr)
            return None
        if round_index == 0:
            continue  # the first round warms Redis' and the allocator's memory
        for mode in MODES:
            measured.times[mode].append(got[mode][0])
        print(f"round {round_index}: " + "  ".join(f"{m} {got[m][0] * 1e3:7.1f} ms" for m in MODES), file=sys.stderr)
    writer.close()
    return measured


def print_results(args: argparse.Namespace, model_path: Path, config: DeviceConfig, measured: Measured) -> None:
    median = {m: statistics.median(measured.times[m]) for m in MODES}
    print(f"model {model_path.name} on {config.device} ({config.dtype}, weights {config.weight_format}), "
          f"{torch.get_num_threads()} threads; "
          f"prompt {args.prompt_tokens} tokens, {args.cached_tokens} cached in chunks of {args.chunk_tokens}; {args.rounds} rounds")
    for mode in MODES:
        print(f"{mode:5s} TTFT {median[mode] * 1e3:8.1f} ms (median)")
    print(f"miss/off={median['miss'] / median['off']:.3f}")
    print(f"l2/miss={median['l2'] / median['miss']:.3f}")
    print(f"l1/miss={median['l1'] / median['miss']:.3f}")
    print(f"bytes_per_cached_token={statistics.median(measured.bytes_per_token):.0f}")
    print("redis_round_trips_per_request=" + " ".join(f"{m}:{statistics.median(t):.0f}" for m, t in measured.trips.items())
          + " (1 lookup when L1 lacks the prefix, plus background writes)")


def run(args: argparse.Namespace) -> int:
    if args.cached_tokens % args.chunk_tokens or args.cached_tokens >= args.prompt_tokens:
        print("loraplex bench-cache: --cached-tokens must be whole chunks and less than --prompt-tokens", file=sys.stderr)
        return 2
    config = DeviceConfig.of(args.device_settings)
    config.apply_to_process()
    model_path = resolve_model_path(args.model)
    runner = ModelRunner.from_paths(model_path, [], config)
    redis_config = RedisConfig(url=args.redis, key_prefix=f"loraplex-bench-{uuid.uuid4().hex[:8]}", ttl_s=600, timeout_s=2.0)
    cache_config = PrefixCacheConfig(chunk_tokens=args.chunk_tokens, redis=redis_config, l1_bytes=4 << 30)
    client = open_prefix_cache(runner, cache_config).tier.client
    try:
        client.ping()
    except Exception as e:  # the client's errors vary with the URL; any of them means no benchmark
        print(f"loraplex bench-cache: Redis at {redis_config.safe_url} is not reachable: {e}", file=sys.stderr)
        return 1
    measured = measure(args, runner, cache_config)
    if measured is None:
        return 1
    delete_keys(client, f"{redis_config.key_prefix}:")
    print_results(args, model_path, config, measured)
    return 0
