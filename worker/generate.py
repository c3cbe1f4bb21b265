"""Generate from one prompt: prefill, then decode token by token with streaming."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from worker.runner import ModelRunner
from worker.sampling import SamplingParams, make_generator, sample
from worker.tokenizer import GGUFTokenizer, IncrementalDecoder


class RequestError(ValueError):
    """The request cannot run as given (nothing was computed)."""


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # the K most likely tokens at this position


@dataclass
class GenerationResult:
    prompt_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str = "length"
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None  # first prompt token has none
    alora_activation: int | None = None
    prompt_time_s: float = 0.0
    decode_time_s: float = 0.0


def _logprob_entry(logprobs: torch.Tensor, token_id: int, k: int) -> TokenLogprob:
    top = torch.topk(logprobs, k) if k > 0 else None
    pairs = list(zip(top.indices.tolist(), top.values.tolist())) if top is not None else []
    return TokenLogprob(token_id, float(logprobs[token_id]), pairs)


def validate_request(runner: ModelRunner, prompt_ids: Sequence[int], params: SamplingParams) -> int:
    """Check a request before any work; returns the KV length it needs."""
    if not prompt_ids:
        raise RequestError("the prompt is empty")
    vocab = runner.hparams.vocab_size
    bad = [t for t in prompt_ids if not 0 <= t < vocab]
    if bad:
        raise RequestError(f"prompt token id {bad[0]} is out of range (vocabulary size {vocab})")
    context = runner.hparams.context_length
    if params.max_tokens == -1:
        if len(prompt_ids) >= context:
            raise RequestError(f"the prompt ({len(prompt_ids)} tokens) does not fit the context length ({context})")
        return context
    if len(prompt_ids) + params.max_tokens > context:
        raise RequestError(
            f"the prompt ({len(prompt_ids)} tokens) plus max_tokens ({params.max_tokens}) "
            f"exceeds the model's context length ({context})"
        )
    return len(prompt_ids) + params.max_tokens


def generate(
    runner: ModelRunner,
    prompt_ids: Sequence[int],
    params: SamplingParams,
    adapter_scales: Mapping[int, float] | None = None,
    tokenizer: GGUFTokenizer | None = None,
    on_text: Callable[[str], None] | None = None,
) -> GenerationResult:
    """Generate for one prompt with the given adapter slots and scales.

    `on_text` receives text as it is produced, whole UTF-8 characters only.
    """
    prompt_ids = list(prompt_ids)
    max_len = validate_request(runner, prompt_ids, params)
    scales = runner.adapter_scales(prompt_ids, adapter_scales or {})
    eog_ids = tokenizer.eog_ids if tokenizer is not None else frozenset()
    masked_ids = sorted(eog_ids) if params.ignore_eos else []
    result = GenerationResult(prompt_ids, alora_activation=scales.alora_activation)
    want_logprobs = params.logprobs is not None
    if want_logprobs:
        result.logprobs = []
    decoder = IncrementalDecoder(tokenizer) if tokenizer is not None else None
    pieces: list[str] = []

    def emit(text: str) -> None:
        if text:
            pieces.append(text)
            if on_text is not None:
                on_text(text)

    def mask_eog(logits: torch.Tensor) -> torch.Tensor:
        if not masked_ids:
            return logits
        logits = logits.clone()
        logits[..., masked_ids] = float("-inf")
        return logits

    generator = make_generator(params.seed, runner.config.torch_device)
    cache = runner.new_cache(max_len)
    started = time.perf_counter()
    need_prompt_logprobs = params.echo and want_logprobs
    logits = runner.forward(prompt_ids, 0, cache, scales.prompt, scales.active_slots, all_logits=need_prompt_logprobs)
    if need_prompt_logprobs:
        lp = torch.log_softmax(logits[:-1], dim=-1)  # reported from the model's own distribution
        result.prompt_logprobs = [None] + [_logprob_entry(lp[i], prompt_ids[i + 1], params.logprobs) for i in range(len(prompt_ids) - 1)]
        logits = logits[-1:]
    result.prompt_time_s = time.perf_counter() - started

    started = time.perf_counter()
    position = len(prompt_ids)
    budget = max_len - len(prompt_ids)
    while len(result.token_ids) < budget:
        token = sample(mask_eog(logits[0]), params, generator)
        if token in eog_ids:  # never sampled with ignore_eos: masked
            result.finish_reason = "stop"
            break
        result.token_ids.append(token)
        if want_logprobs:
            result.logprobs.append(_logprob_entry(torch.log_softmax(logits[0], dim=-1), token, params.logprobs))
        if decoder is not None:
            emit(decoder.push(token))
        if len(result.token_ids) == budget:
            break
        logits = runner.forward([token], position, cache, scales.generated, scales.active_slots)
        position += 1
    if decoder is not None:
        emit(decoder.flush())
    result.text = "".join(pieces)
    result.decode_time_s = time.perf_counter() - started
    return result

