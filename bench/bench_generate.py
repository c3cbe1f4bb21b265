"""Batch-1 greedy decoding speed of the default model, base vs. with adapters, side by side.

    python bench/bench_generate.py [--tokens 64] [--rounds 3] [--device cpu] [--dtype float32]

Prints model load time, tokens/s per configuration (median of rounds, the
configurations interleaved so machine noise hits them alike) and each
configuration's speed relative to the base model.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from worker.contract.params import SamplingParams
from worker.engine.generate import generate
from worker.engine.runner import ModelRunner
from worker.formats.default_model import default_model_path
from worker.formats.tokenizer import GGUFTokenizer
from worker.model.device import DeviceConfig

ADAPTER = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "small.gguf"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args()

    started = time.perf_counter()
    runner = ModelRunner.from_paths(default_model_path(), [ADAPTER, ADAPTER], DeviceConfig(args.device, args.dtype))
    load_s = time.perf_counter() - started
    tokenizer = GGUFTokenizer(runner.base)
    prompt = tokenizer.encode(
        "<|im_start|>user\nWrite a short story about a lighthouse.<|im_end|>\n<|im_start|>assistant\n", parse_special=True
    )
    params = SamplingParams(max_tokens=args.tokens, temperature=0, ignore_eos=True)
    configs = {"base": {}, "1 adapter": {0: 1.0}, "2 adapters stacked": {0: 0.5, 1: 0.5}}
    generate(runner, prompt, SamplingParams(max_tokens=4, temperature=0), {}, tokenizer)  # warm-up
    rates: dict[str, list[float]] = {name: [] for name in configs}
    for _ in range(args.rounds):
        for name, scales in configs.items():
            result = generate(runner, prompt, params, scales, tokenizer)
            rates[name].append(len(result.token_ids) / result.decode_time_s)
    print(f"device {args.device} ({args.dtype}), torch threads {torch.get_num_threads()}, prompt {len(prompt)} tokens, "
          f"{args.tokens} generated")
    print(f"model load (incl. 2 adapters): {load_s:.2f} s")
    base = statistics.median(rates["base"])
    for name, values in rates.items():
        median = statistics.median(values)
        print(f"{name:<20} {median:7.1f} tokens/s   x{median / base:.2f} of base   (rounds: {', '.join(f'{v:.1f}' for v in values)})")


if __name__ == "__main__":
    main()
