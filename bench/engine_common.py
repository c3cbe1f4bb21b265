"""What the engine benchmarks share: random adapters written as GGUF files, a runner holding
them, the requests of a workload given each request's adapter, and engine steps timed one by one."""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from gguf import GGUFWriter

from worker.contract.calls import Delta
from worker.contract.params import SamplingParams
from worker.contract.spec import EngineConfig
from worker.engine.engine import Engine, EngineRequest
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
