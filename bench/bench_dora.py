"""`loraplex bench-engine --dora`: what serving DoRA adapters unmerged costs in mixed batches.

One runner holds A plain LoRA adapters (slots 0..A-1) and A DoRA adapters of the same rank on the
same targets (slots A..2A-1; worker/lora/weights.py rescales a DoRA row per output channel with
a factor made once per adapter and scale). The same mixed workload (`--requests` requests,
request i on the i % A-th adapter of its kind) runs on each kind, interleaved per round so that
machine noise hits both alike. Printed: decode tokens/s of each and the ratio DoRA / LoRA.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench.engine_common import make_requests, run_policy, write_random_adapters
from worker.engine.runner import ModelRunner
from worker.formats.adapter import load_adapter
from worker.formats.default_model import resolve_model_path
from worker.formats.gguf_file import GGUFFile
from worker.model.device import DeviceConfig


def run(args: argparse.Namespace) -> int:
    config = DeviceConfig.of(args.device_settings)
    config.apply_to_process()
    model_path = resolve_model_path(args.model)
    base = GGUFFile(model_path)
    with tempfile.TemporaryDirectory() as tmp:
        print(f"writing {args.adapters} random rank-{args.rank} LoRA and as many DoRA adapters ({args.targets})...",
              file=sys.stderr)
        paths = write_random_adapters(base, Path(tmp), args.adapters, args.rank, args.targets, args.seed)
        paths += write_random_adapters(base, Path(tmp), args.adapters, args.rank, args.targets, args.seed + 1, dora=True)
        started = time.perf_counter()
        runner = ModelRunner(base, [load_adapter(p, base) for p in paths], config)
        load_s = time.perf_counter() - started
    assert all(runner.adapters[args.adapters + i].is_dora for i in range(args.adapters))
    vocab = runner.hparams.vocab_size
    kinds = {"lora": [i % args.adapters for i in range(args.requests)],
             "dora": [args.adapters + i % args.adapters for i in range(args.requests)]}
    warm = argparse.Namespace(**{**vars(args), "max_tokens": 2})
    for slots in kinds.values():
        run_policy(runner, [make_requests(warm, vocab, slots)[:2]], warm)
    totals = {kind: [0.0, 0] for kind in kinds}
    for round_index in range(args.rounds):
        for kind, slots in (kinds.items() if round_index % 2 == 0 else reversed(kinds.items())):
            seconds, tokens = run_policy(runner, [make_requests(args, vocab, slots)], args)
            totals[kind][0] += seconds
            totals[kind][1] += tokens
            print(f"round {round_index + 1} {kind} {tokens / seconds:8.1f} decode tokens/s", file=sys.stderr)
    rate = {kind: tokens / seconds for kind, (seconds, tokens) in totals.items()}
    print(f"model {Path(model_path).name} on {config.device} ({config.dtype}), {torch.get_num_threads()} threads; "
          f"{args.requests} mixed requests x ({args.prompt_tokens} prompt + {args.max_tokens} new) tokens over "
          f"{args.adapters} rank-{args.rank} adapters of each kind on {args.targets}; loaded in {load_s:.1f} s")
    print(f"plain LoRA {rate['lora']:8.1f} decode tokens/s")
    print(f"DoRA       {rate['dora']:8.1f} decode tokens/s")
    print(f"dora/lora={rate['dora'] / rate['lora']:.3f}")
    return 0
