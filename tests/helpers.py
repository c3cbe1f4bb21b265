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


def channel_to(worker, break_after: int | None = None):
    """A gateway's channel (gateway/cluster/channel.py) to an in-process ShardWorker, as production
    reaches a replica over Ray; with `break_after`, the transport dies after that many batches."""
    from contextlib import aclosing

    from gateway.cluster.channel import ReplicaChannel

    async def batches(channel_id: str):
        n = 0
        async with aclosing(worker.channel(channel_id)) as opened:
            async for batch in opened:
                if break_after is not None and n >= break_after:
                    raise ConnectionError("the replica died")
                n += 1
                yield batch

    return ReplicaChannel(batches, worker.start, worker.cancel)


async def deltas_of(worker, call) -> list:
    """Every delta of `call` on an in-process ShardWorker, through a channel of its own."""
    from gateway.cluster.pool import WorkerFailed

    channel = channel_to(worker)
    try:
        return [delta async for delta in channel.stream(call)]
    finally:
        channel.fail(WorkerFailed("the caller is done with this channel"))


def results_of(deltas, request_id: str) -> dict:
    """Each finished choice of `request_id` (index -> GenerationResult), put together from the
    deltas the engine gave for it: what a caller of the engine sees of its result."""
    from worker.engine.outputs import GenerationResult

    results: dict[int, GenerationResult] = {}
    finished = set()
    for delta in deltas:
        if delta.request_id != request_id:
            continue
        result = results.setdefault(delta.index, GenerationResult([]))
        result.token_ids += delta.token_ids
        result.text += delta.text
        if delta.logprobs is not None:
            result.logprobs = (result.logprobs or []) + list(delta.logprobs)
        if delta.finish_reason is not None:
            finished.add(delta.index)
            result.finish_reason, result.error, result.error_status = delta.finish_reason, delta.error, delta.status
            result.stop_logprob, result.alora_activation = delta.stop_logprob, delta.alora_activation
            result.prompt_logprobs = list(delta.prompt_logprobs) if delta.prompt_logprobs is not None else None
            if delta.usage is not None:
                result.cached_tokens = delta.usage.cached_tokens
    return {i: r for i, r in results.items() if i in finished}
