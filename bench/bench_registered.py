"""`loraplex bench-engine --registered 16,256,1024`: does a decode step cost what the batch's
adapters cost, or what the worker holds? The same mixed workload (request i on adapter
i % A) runs while the worker holds N adapters for each N, interleaved per round: the
A in use plus N - A others, each with its own random weights in memory, added and
removed between runs as the registry does while serving.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from bench.engine_common import make_requests, run_policy, write_random_adapters
from worker.engine.runner import ModelRunner
from worker.formats.adapter import LoRAAdapter, load_adapter
from worker.formats.default_model import resolve_model_path
from worker.formats.gguf_file import GGUFFile
from worker.model.device import DeviceConfig


class HeldAdapter:
    """An adapter shaped like `template`, with its own random weights (made once, on the host)."""

    def __init__(self, template: LoRAAdapter, index: int, rng: np.random.Generator) -> None:
        self.pairs, self.alpha, self.invocation_tokens = template.pairs, template.alpha, None
        self.is_dora = False  # its own random A and B, no magnitudes
        self.fingerprint = f"held-{index}"
        self._template = template
        self._arrays = {}
        for target in template.pairs:
            a, b = template.load_pair(target)
            self._arrays[target] = (
                rng.standard_normal(a.shape, dtype=np.float32) * 0.05,
                rng.standard_normal(b.shape, dtype=np.float32) * 0.01,
            )

    def load_pair(self, target: str) -> tuple[np.ndarray, np.ndarray]:
        return self._arrays[target]

    def scale(self, pair, adapter_scale: float) -> float:
        return self._template.scale(pair, adapter_scale)


def run(args: argparse.Namespace) -> int:
    counts = sorted(set(args.registered))
    if counts[0] < args.adapters:
        print(f"loraplex bench-engine: --registered counts must be at least --adapters ({args.adapters})", file=sys.stderr)
        return 2
    config = DeviceConfig.of(args.device_settings)
    config.apply_to_process()
    model_path = resolve_model_path(args.model)
    base = GGUFFile(model_path)
    with tempfile.TemporaryDirectory() as tmp:
        paths = write_random_adapters(base, Path(tmp), args.adapters, args.rank, args.targets, args.seed)
        used = [load_adapter(p, base) for p in paths]
        runner = ModelRunner(base, used, config)
        print(f"making {counts[-1] - args.adapters} more rank-{args.rank} adapters ({args.targets}) to hold...", file=sys.stderr)
        rng = np.random.default_rng(args.seed + 1)
        extra = [HeldAdapter(used[i % len(used)], i, rng) for i in range(counts[-1] - args.adapters)]
    vocab = runner.hparams.vocab_size
    spread = [i % args.adapters for i in range(args.requests)]
    held: list[int] = []  # slots of the extra adapters now held

    def hold(n: int) -> float:
        started = time.perf_counter()
        while len(held) > n - args.adapters:
            runner.remove_adapter(held.pop())
        while len(held) < n - args.adapters:
            held.append(runner.add_adapter(extra[len(held)]))
        return time.perf_counter() - started

    warm = argparse.Namespace(**{**vars(args), "max_tokens": 2})
    run_policy(runner, [make_requests(warm, vocab, spread)[:2]], warm)
    totals = {n: [0.0, 0] for n in counts}
    for round_index in range(args.rounds):
        for n in counts if round_index % 2 == 0 else reversed(counts):
            changed_s = hold(n)
            seconds, tokens = run_policy(runner, [make_requests(args, vocab, spread)], args)
            totals[n][0] += seconds
            totals[n][1] += tokens
            print(f"round {round_index + 1} holding {n:5d}: {tokens / seconds:8.1f} decode tokens/s "
                  f"(held set changed in {changed_s:.2f} s)",
                  file=sys.stderr)
    hold(counts[-1])
    rate = {n: tokens / seconds for n, (seconds, tokens) in totals.items()}
    print(f"model {model_path.name} on {config.device} ({config.dtype}), {torch.get_num_threads()} threads; {args.requests} requests over "
          f"{args.adapters} rank-{args.rank} adapters on {args.targets}, ({args.prompt_tokens} prompt + {args.max_tokens} new) tokens each")
    print(f"adapter weights held at {counts[-1]}: {runner.lora.nbytes() / 1e6:.0f} MB")
    for n in counts:
        print(f"holding {n:5d} adapters: {rate[n]:8.1f} decode tokens/s  ({rate[n] / rate[counts[0]]:.2f}x of {counts[0]})")
    print(f"held{counts[-1]}/held{counts[0]}={rate[counts[-1]] / rate[counts[0]]:.2f}")
    return 0
