"""`loraplex generate --batch-file`: many requests, with their own adapters, run together."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from cache.l2 import RedisConfig
from cache.prefix import PrefixCache, PrefixCacheConfig
from worker.contract.params import SamplingParams
from worker.contract.spec import DEFAULT_SLOT_LEN, EngineConfig
from worker.engine.engine import Engine, EngineRequest, RequestError
from worker.engine.generate import check_tokens
from worker.engine.runner import ModelRunner
from worker.formats.tokenizer import GGUFTokenizer, TokenizerError

MAX_SLOTS = 64  # lines beyond this wait for a free KV slot
SAMPLING_FIELDS = ("max_tokens", "temperature", "top_p", "top_k", "seed", "ignore_eos")
FIELDS = {"prompt", "prompt_tokens", "lora", "stop", "cache_salt", *SAMPLING_FIELDS}


class BatchFileError(ValueError):
    pass


def open_cli_cache(args: argparse.Namespace, runner: ModelRunner) -> PrefixCache | None:
    """The prefix cache `--redis` asks for (None without it)."""
    if args.redis is None:
        if args.cache_salt:
            raise RequestError("--cache-salt needs --redis")
        return None
    from worker.engine.prefix_kv import open_prefix_cache

    config = PrefixCacheConfig(chunk_tokens=args.cache_chunk_tokens, redis=RedisConfig(url=args.redis, key_prefix=args.cache_prefix))
    return open_prefix_cache(runner, config)


def close_cli_cache(cache: PrefixCache | None) -> None:
    """Let queued writes reach Redis before the process exits; say so when Redis was not there."""
    if cache is None:
        return
    cache.close()
    if cache.redis_state == "degraded":
        print(f"loraplex: Redis at {cache.config.redis.safe_url} was unavailable: ran uncached", file=sys.stderr)


def read_batch_file(path: str) -> list[dict[str, Any]]:
    lines = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                item = json.loads(line)
            except json.JSONDecodeError as e:
                raise BatchFileError(f"{path}:{number}: not valid JSON: {e.msg}") from e
            if not isinstance(item, dict):
                raise BatchFileError(f"{path}:{number}: expected a JSON object")
            unknown = sorted(set(item) - FIELDS)
            if unknown:
                raise BatchFileError(f"{path}:{number}: unknown field {unknown[0]!r} (known: {', '.join(sorted(FIELDS))})")
            if ("prompt" in item) == ("prompt_tokens" in item):
                raise BatchFileError(f"{path}:{number}: give exactly one of 'prompt' and 'prompt_tokens'")
            lora = item.get("lora", [])
            if not isinstance(lora, list) or not all(isinstance(x, dict) and isinstance(x.get("path"), str) for x in lora):
                raise BatchFileError(f"{path}:{number}: 'lora' must be a list of {{\"path\": ..., \"scale\": ...}}")
            if not isinstance(item.get("cache_salt", ""), str):
                raise BatchFileError(f"{path}:{number}: 'cache_salt' must be a string")
            item["_line"] = number
            lines.append(item)
    if not lines:
        raise BatchFileError(f"{path}: no requests")
    return lines


def adapter_paths(lines: list[dict[str, Any]], base_dir: str) -> list[str]:
    """Every adapter any line names, once, in order of first use (relative to the batch file)."""
    seen: dict[str, None] = {}
    for item in lines:
        for entry in item.get("lora", []):
            seen.setdefault(os.path.normpath(os.path.join(base_dir, entry["path"])), None)
    return list(seen)


def build_requests(
    lines, args: argparse.Namespace, tokenizer: GGUFTokenizer | None, slots: dict[str, int], base_dir: str, where: str
) -> list[EngineRequest]:
    requests = []
    for index, item in enumerate(lines):
        at = f"{where}:{item['_line']}"
        defaults = {"max_tokens": args.n_predict, "temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k,
                    "seed": args.seed, "ignore_eos": args.ignore_eos, "min_p": args.min_p, "repeat_penalty": args.repeat_penalty,
                    "presence_penalty": args.presence_penalty, "frequency_penalty": args.frequency_penalty,
                    "penalty_last_n": args.repeat_last_n}
        try:
            stop = item.get("stop", [])
            stop = (stop,) if isinstance(stop, str) else tuple(stop)
            bias = tuple((int(t), float(b)) for t, b in item["logit_bias"]) if "logit_bias" in item else tuple(args.logit_bias)
            params = SamplingParams(**{k: item.get(k, v) for k, v in defaults.items()}, stop=stop, logit_bias=bias, penalize_prompt=True)
            if "prompt_tokens" in item:
                prompt = [int(t) for t in item["prompt_tokens"]]
            elif tokenizer is None:
                raise RequestError("this model's tokenizer is not supported: use prompt_tokens")
            else:
                prompt = tokenizer.encode(item["prompt"], add_special=True, parse_special=True)
            scales: dict[int, float] = {}
            for entry in item.get("lora", []):
                slot = slots[os.path.normpath(os.path.join(base_dir, entry["path"]))]
                scales[slot] = scales.get(slot, 0.0) + float(entry.get("scale", 1.0))
        except (TypeError, ValueError) as e:
            raise BatchFileError(f"{at}: {e}") from e
        requests.append(EngineRequest(str(index), prompt, params, scales, cache_salt=item.get("cache_salt", args.cache_salt)))
    return requests


def run_batch(args: argparse.Namespace, runner_from_paths) -> int:
    lines = read_batch_file(args.batch_file)
    base_dir = os.path.dirname(os.path.abspath(args.batch_file))
    paths = adapter_paths(lines, base_dir)
    runner: ModelRunner = runner_from_paths(paths)
    try:
        tokenizer: GGUFTokenizer | None = GGUFTokenizer(runner.base)
    except TokenizerError:
        if any("prompt" in item for item in lines):
            raise
        tokenizer = None
    requests = build_requests(lines, args, tokenizer, {p: i for i, p in enumerate(paths)}, base_dir, args.batch_file)
    context = runner.hparams.context_length
    if any(r.params.max_tokens == -1 for r in requests):  # until the end of generation: a default-sized slot
        slot_len = min(context, max(DEFAULT_SLOT_LEN, *(len(r.prompt_ids) + 1 for r in requests)))
    else:
        slot_len = min(context, max(len(r.prompt_ids) + max(r.params.max_tokens, 1) for r in requests))
    num_slots = min(len(requests), MAX_SLOTS)
    cache = open_cli_cache(args, runner)
    engine = Engine(
        runner,
        tokenizer,
        EngineConfig(num_seq_slots=num_slots, slot_len=slot_len, max_step_tokens=max(args.step_tokens, num_slots)),
        prefix_cache=cache,
    )
    checked = []
    for request, item in zip(requests, lines):
        try:
            check_tokens(runner, request.prompt_ids, request.params)
            checked.append(engine.check(request))
        except ValueError as e:
            raise BatchFileError(f"{args.batch_file}:{item['_line']}: {e}") from e
    results = engine.run_all(checked)
    close_cli_cache(cache)
    for request in requests:
        result = results[request.request_id]
        out = {"index": int(request.request_id), "text": result.text, "tokens": result.token_ids,
               "finish_reason": result.finish_reason, "prompt_tokens": len(result.prompt_ids), "cached_tokens": result.cached_tokens}
        if result.error:
            out["error"] = result.error
        if result.alora_activation is not None:
            out["alora_activation"] = result.alora_activation
        print(json.dumps(out, ensure_ascii=False))
    return 0
