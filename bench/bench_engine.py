"""`loraplex bench-engine`: decode speed of one adapter, mixed adapters, and llama.cpp's policy.

The same workload runs three ways in one process, interleaved per round so
machine noise hits all three alike:
- same: every request uses adapter 0, all batched together;
- mixed: request i uses adapter i % N, all batched together (our engine);
- llama_policy: only requests with the same adapter share a forward pass
  (llama-server's behaviour); the adapter groups take turns step by step.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from gguf import GGUFWriter

from worker.contract.params import SamplingParams
from worker.contract.spec import EngineConfig
from worker.engine.engine import Engine, EngineRequest
from worker.contract.calls import Delta
from worker.engine.runner import ModelRunner
from worker.formats.adapter import load_adapter
from worker.formats.default_model import resolve_model_path
from worker.formats.dora import DORA_KEY, MAGNITUDE_SUFFIX
from worker.formats.gguf_file import GGUFFile
from worker.formats.hparams import ModelHParams
from worker.model.device import DeviceConfig

TARGETS = {
    "qv": ["attn_q", "attn_v"],
    "attn": ["attn_q", "attn_k", "attn_v", "attn_output"],
    "all": ["attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down", "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"],
}  # of a model's layers, those it has (dense FFN or MoE experts)


def write_random_adapters(base: GGUFFile, directory: Path, num: int, rank: int, targets: str, seed: int,
                          dora: bool = False) -> list[Path]:
    """`num` adapters with random weights; with `dora`, DoRA adapters (a magnitude per linear target)."""
    hp = ModelHParams.from_gguf(base)
    rng = np.random.default_rng(seed)
    paths = []
    for i in range(num):
        path = directory / f"random-{'dora-' if dora else ''}{i}.gguf"
        w = GGUFWriter(str(path), hp.arch)
        w.add_string("general.type", "adapter")
        w.add_string("adapter.type", "lora")
        w.add_float32("adapter.lora.alpha", float(rank))
        if dora:
            w.add_bool(DORA_KEY, True)
        for layer in range(hp.num_layers):
            for name in TARGETS[targets]:
                info = base.tensors.get(f"blk.{layer}.{name}.weight")
                if info is None:
                    continue
                d_in, d_out, experts = info.ne(0), info.ne(1), (info.ne(2),) if len(info.shape) == 3 else ()
                w.add_tensor(
                    f"blk.{layer}.{name}.weight.lora_a", (rng.standard_normal((*experts, rank, d_in)) / d_in**0.5).astype(np.float32)
                )
                w.add_tensor(f"blk.{layer}.{name}.weight.lora_b", (rng.standard_normal((*experts, d_out, rank)) * 0.01).astype(np.float32))
                if dora and not experts:  # a magnitude near the base's row norms' scale, per output channel
                    w.add_tensor(f"blk.{layer}.{name}.weight{MAGNITUDE_SUFFIX}", (1 + 0.1 * rng.standard_normal(d_out)).astype(np.float32))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        paths.append(path)
    return paths


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


def runner_with_random_adapters(args: argparse.Namespace) -> tuple[Path, ModelRunner, float]:
    """The base model of the workload flags with `args.adapters` random adapters, on the device
    flags' device: (the model's path, the runner, seconds to load it)."""
    config = DeviceConfig.of(args.device_settings)
    config.apply_to_process()
    model_path = resolve_model_path(args.model)
    base = GGUFFile(model_path)
    with tempfile.TemporaryDirectory() as tmp:
        print(f"writing {args.adapters} random rank-{args.rank} adapters ({args.targets})...", file=sys.stderr)
        paths = write_random_adapters(base, Path(tmp), args.adapters, args.rank, args.targets, args.seed)
        started = time.perf_counter()
        runner = ModelRunner(base, [load_adapter(p, base) for p in paths], config)
        return Path(model_path), runner, time.perf_counter() - started


def make_requests(args: argparse.Namespace, vocab: int, adapter_of: list[int]) -> list[EngineRequest]:
    rng = np.random.default_rng(args.seed)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    return [
        EngineRequest(str(i), rng.integers(100, vocab, args.prompt_tokens).tolist(), params, {adapter_of[i]: 1.0})
        for i in range(args.requests)
    ]


def run_policy(runner: ModelRunner, groups: list[list[EngineRequest]], args: argparse.Namespace) -> tuple[float, int]:
    """Each group in its own engine; the engines take turns one step each.
    Returns (decode seconds, decode tokens): steps that only decode."""
    slot_len = args.prompt_tokens + args.max_tokens
    engines = []
    for group in groups:
        engine = Engine(
            runner, None, EngineConfig(num_seq_slots=len(group), slot_len=slot_len, max_step_tokens=max(args.step_tokens, len(group)))
        )
        for request in group:
            engine.add_request(request)
        engines.append(engine)
    decode_s, decode_tokens = 0.0, 0
    while any(e.has_work() for e in engines):
        for engine in engines:
            if not engine.has_work():
                continue
            is_decode = not any(seq.is_prefilling for seq in engine.scheduler.running) and not engine.scheduler.num_waiting
            seconds, outputs = timed_step(engine)
            if is_decode:
                decode_s += seconds
                decode_tokens += sum(len(o.token_ids) for o in outputs)
    return decode_s, decode_tokens


def timed_step(engine: Engine) -> tuple[float, list[Delta]]:
    """One engine step: (its seconds, its outputs)."""
    started = time.perf_counter()
    outputs = engine.step()
    return time.perf_counter() - started, outputs


def run(args: argparse.Namespace) -> int:
    if args.dora:
        from bench.bench_dora import run as run_dora

        return run_dora(args)
    if args.device_adapters is not None:
        from bench.bench_tiers import run as run_tiers

        return run_tiers(args)
    if args.registered:
        from bench.bench_registered import run as run_registered

        return run_registered(args)
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
