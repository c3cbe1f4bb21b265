"""`loraplex bench-structured`: what a JSON schema per request costs the decode rate.

16 requests, each on its own random adapter, decode together in one engine twice per round,
interleaved: free (no grammar; `ignore_eos`, so all run to max_tokens) and constrained (each with one
of SCHEMAS: its tokens masked by llguidance every step). Only steps in which every request decodes
are timed, so the unequal lengths of constrained answers do not count, only the per-token cost.
Also prints the compile time of each schema (llguidance, first use; later uses hit the cache).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

import torch

from bench.engine_common import timed_step, write_random_adapters
from worker.contract.params import SamplingParams
from worker.contract.spec import EngineConfig
from worker.engine.engine import Engine, EngineRequest
from worker.engine.runner import ModelRunner
from worker.formats.adapter import load_adapter
from worker.formats.chat_template import encode_chat
from worker.formats.default_model import resolve_model_path
from worker.formats.gguf_file import GGUFFile
from worker.formats.grammar import json_schema_grammar
from worker.formats.tokenizer import GGUFTokenizer
from worker.model.device import DeviceConfig

_TEXT = {"type": "string", "maxLength": 400}
SCHEMAS = [  # what tenants send: extraction, classification, nested records, lists
    {"type": "object", "properties": {"name": _TEXT, "email": _TEXT, "age": {"type": "integer", "minimum": 0, "maximum": 150}},
     "required": ["name", "email", "age"], "additionalProperties": False},
    {"type": "object", "properties": {"label": {"enum": ["positive", "negative", "neutral"]},
                                      "confidence": {"type": "number", "minimum": 0, "maximum": 1}},
     "required": ["label", "confidence"]},
    {"type": "object", "properties": {"items": {"type": "array", "items": {"type": "object", "properties": {
        "sku": _TEXT, "qty": {"type": "integer", "minimum": 1}}, "required": ["sku", "qty"]}}}, "required": ["items"]},
    {"type": "object", "properties": {"summary": _TEXT, "tags": {"type": "array", "items": _TEXT, "maxItems": 20},
                                      "meta": {"anyOf": [{"type": "null"}, {"type": "object", "properties": {"lang": _TEXT}}]}},
     "required": ["summary", "tags", "meta"]},
]


def _requests(prompt: list[int], count: int, max_tokens: int, constrained: bool) -> list[EngineRequest]:
    requests = []
    for i in range(count):
        grammar = json_schema_grammar(SCHEMAS[i % len(SCHEMAS)]) if constrained else None
        params = SamplingParams(max_tokens=max_tokens, temperature=0.8, seed=i, ignore_eos=not constrained, grammar=grammar)
        requests.append(EngineRequest(f"r{i}", prompt, params, {i: 1.0}))
    return requests


def _decode_rate(engine: Engine, requests: list[EngineRequest]) -> tuple[float, int]:
    """(seconds, tokens) of the steps in which all requests decode."""
    for request in requests:
        engine.add_request(request)
    seconds, tokens = 0.0, 0
    while engine.has_work():
        full = len(engine.scheduler.running) == len(requests) and not any(s.is_prefilling for s in engine.scheduler.running)
        step_s, outputs = timed_step(engine)
        if full:
            seconds, tokens = seconds + step_s, tokens + sum(len(o.token_ids) for o in outputs)
    return seconds, tokens


def run(args: argparse.Namespace) -> int:
    config = DeviceConfig.of(args.device_settings)
    config.apply_to_process()
    base = GGUFFile(resolve_model_path(args.model))
    tokenizer = GGUFTokenizer(base)
    with tempfile.TemporaryDirectory() as tmp:
        paths = write_random_adapters(base, Path(tmp), args.requests, args.rank, "all", args.seed)
        runner = ModelRunner(base, [load_adapter(p, base) for p in paths], config)
    prompt = encode_chat(tokenizer, [{"role": "user", "content": "Describe a customer order as JSON."}])
    engine = Engine(
        runner, tokenizer, EngineConfig(num_seq_slots=args.requests, slot_len=len(prompt) + args.max_tokens, max_step_tokens=512)
    )
    _decode_rate(engine, _requests(prompt, len(SCHEMAS), 2, True))  # warm-up: compiles each schema once, builds llguidance's tokenizer
    compile_ms = [s * 1000 for s in engine.grammars.compile_s]
    totals = {"free": [0.0, 0], "schema": [0.0, 0]}
    for round_index in range(args.rounds):
        for name in totals:
            seconds, tokens = _decode_rate(engine, _requests(prompt, args.requests, args.max_tokens, name == "schema"))
            totals[name][0] += seconds
            totals[name][1] += tokens
            print(f"round {round_index + 1} {name:6s} {tokens / max(seconds, 1e-9):8.1f} decode tokens/s", file=sys.stderr)
    rate = {name: tokens / max(seconds, 1e-9) for name, (seconds, tokens) in totals.items()}
    print(f"model {base.path.name} on {config.device}, {torch.get_num_threads()} threads; {args.requests} requests on {args.requests} "
          f"rank-{args.rank} adapters, up to {args.max_tokens} new tokens")
    print(f"free     {rate['free']:8.1f} decode tokens/s")
    print(f"schema   {rate['schema']:8.1f} decode tokens/s (one of {len(SCHEMAS)} JSON schemas per request)")
    print(f"grammar compile ms: p50 {statistics.median(compile_ms):.2f}, max {max(compile_ms):.2f} ({len(compile_ms)} schemas)")
    print(f"schema/free={rate['schema'] / rate['free']:.2f}")
    return 0
