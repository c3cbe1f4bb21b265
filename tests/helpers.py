"""Small helpers shared by tests."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

import torch

from worker.contract.params import SamplingParams
from worker.engine.generate import generate
from worker.engine.runner import ModelRunner
from worker.model.device import DeviceConfig

# The whole suite runs on another device with LORAPLEX_TEST_DEVICE=cuda (float32 there too).
TEST_DEVICE = DeviceConfig(device=os.environ.get("LORAPLEX_TEST_DEVICE", "cpu"))


def prompt_logits(runner: ModelRunner, ids: Sequence[int], scales: Mapping[int, float] | None = None) -> torch.Tensor:
    """Logits [T, V] (float32, on the CPU) for every position of `ids` with the given adapter slot scales."""
    kv = runner.allocate_kv(1, len(ids))
    return runner.forward(ids, 0, kv, runner.resolve_adapters(ids, scales or {}), all_logits=True).to("cpu", torch.float32, copy=True)


LLAMACPP_SCALES = {"base": 0.0, "small@1.0": 1.0, "small@0.5": 0.5}  # the reference fixtures' adapter configurations
NEAR_TIE = 0.35  # nats: where llama.cpp's 8-bit activations and our float32 may pick either of two tokens


def teacher_forced_against_llama_cpp(runner: ModelRunner, tokenizer, reference: dict) -> tuple[int, int, list]:
    """Feed llama.cpp's greedy completions back (echo, logprobs 5) and compare our top-1 with its
    top-1 at every position. Returns (matched, total, misses); every miss must be a near tie."""
    total = matched = 0
    misses = []
    params = SamplingParams(max_tokens=0, temperature=0, echo=True, logprobs=5, ignore_eos=True)
    for case in reference["completions"]:
        prompt = case["prompt_tokens"]
        assert [s["id"] for s in case["steps"]] == case["tokens"]
        result = generate(runner, prompt + case["tokens"], params, {0: LLAMACPP_SCALES[case["config"]]}, tokenizer)
        for i, step in enumerate(case["steps"]):
            ours, theirs = result.prompt_logprobs[len(prompt) + i].top[0][0], step["top"][0][0]
            total += 1
            if ours == theirs:
                matched += 1
                continue
            gap = step["top"][0][1] - dict((token, lp) for token, lp in step["top"]).get(ours, float("-inf"))
            misses.append((case["config"], i, ours, theirs, gap))
            assert gap <= NEAR_TIE, f"{case['config']} step {i}: we pick {ours}, llama.cpp {theirs}, gap {gap:.3f}"
    return matched, total, misses
