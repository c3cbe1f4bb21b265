"""`loraplex bench-engine`: decode speed of one adapter, mixed adapters, and llama.cpp's policy.

The same workload runs three ways in one process, interleaved per round so
machine noise hits all three alike:
- same: every request uses adapter 0, all batched together;
- mixed: request i uses adapter i % N, all batched together (our engine);
- llama_policy: only requests with the same adapter share a forward pass
  (llama-server's behaviour); the adapter groups take turns step by step.

`--dora`, `--device-adapters`, `--registered` and `--speculative` run bench_dora,
bench_tiers, bench_registered and bench_speculative instead.
"""

from __future__ import annotations

import argparse
import sys

import torch

from bench import bench_dora, bench_registered, bench_speculative, bench_tiers
from bench.engine_common import make_requests, run_policy, runner_with_random_adapters
from worker.engine.runner import ModelRunner


def step_bytes(runner: ModelRunner, num_adapters: int) -> int:
    """Bytes one decode step reads: every base matrix as the engine stores it, but not
    the embedding table (only rows are looked up), plus the stacked adapters in use."""
    model = runner.model
    seen = {model.token_embd.weight.data_ptr()} if isinstance(model.token_embd, torch.nn.Embedding) else set()
    total = 0
    for module in model.modules():
        if isinstance(module, torch.nn.Embedding) or getattr(module, "weights", None) is not None:
            continue
        total += getattr(module, "weight_bytes", 0)  # fbgemm-packed weights live outside parameters
        for tensor in list(module.parameters(recurse=False)) + list(module.buffers(recurse=False)):
            if tensor.data_ptr() not in seen or module is model.output:
                seen.add(tensor.data_ptr())
                total += 0 if tensor.is_complex() or module is model.rope else tensor.numel() * tensor.element_size()
    adapter_bytes = 0
    for module in model.modules():
        weights = getattr(module, "weights", None)  # a LoRA layer: the adapters' own A and B per slot
        if weights is not None and weights.pairs and not isinstance(module.base, torch.nn.Embedding):
            adapter_bytes += weights.nbytes / len(weights.pairs) * min(num_adapters, len(weights.pairs))
    return int(total + adapter_bytes)


def run(args: argparse.Namespace) -> int:
    if args.dora:
        return bench_dora.run(args)
    if args.device_adapters is not None:
        return bench_tiers.run(args)
    if args.registered:
        return bench_registered.run(args)
    if args.speculative:
        return bench_speculative.run(args)
    model_path, runner, load_s = runner_with_random_adapters(args)
    config = runner.config
    vocab = runner.hparams.vocab_size
    same = [0] * args.requests
    spread = [i % args.adapters for i in range(args.requests)]
    workloads = {
        "same": lambda: [make_requests(args, vocab, same)],
        "mixed": lambda: [make_requests(args, vocab, spread)],
        "llama_policy": lambda: [
            [r for r in make_requests(args, vocab, spread) if r.scales_by_slot.get(a)] for a in range(min(args.adapters, args.requests))
        ],
    }
    warm = argparse.Namespace(**{**vars(args), "max_tokens": 2})
    run_policy(runner, [make_requests(warm, vocab, spread)[:2]], warm)
    totals = {name: [0.0, 0] for name in workloads}
    for round_index in range(args.rounds):
        for name, build in workloads.items():
            seconds, tokens = run_policy(runner, build(), args)
            totals[name][0] += seconds
            totals[name][1] += tokens
            print(f"round {round_index + 1} {name:12s} {tokens / seconds:8.1f} decode tokens/s", file=sys.stderr)
    rate = {name: tokens / seconds for name, (seconds, tokens) in totals.items()}
    one, many = step_bytes(runner, 1), step_bytes(runner, args.adapters)
    print(f"model {model_path.name} on {config.device} ({config.dtype}), {torch.get_num_threads()} threads; "
          f"{args.requests} requests x ({args.prompt_tokens} prompt + {args.max_tokens} new) tokens; "
          f"{args.adapters} rank-{args.rank} adapters on {args.targets}")
    print(f"loaded the base and {args.adapters} adapters in {load_s:.2f} s")
    print(f"decode step reads {one / 1e6:.1f} MB with 1 adapter, {many / 1e6:.1f} MB with {args.adapters}")
    for name in workloads:
        print(f"{name:12s} {rate[name]:8.1f} decode tokens/s")
    print(f"mixed_tok_s={rate['mixed']:.1f}")
    print(f"mixed/same={rate['mixed'] / rate['same']:.2f}")
    print(f"byte_bound={one / many:.2f}")
    print(f"mixed/llama_policy={rate['mixed'] / rate['llama_policy']:.2f}")
    return 0
