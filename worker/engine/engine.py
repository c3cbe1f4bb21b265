"""The worker engine: continuous batching of requests with different adapter sets.

One step is: schedule (which tokens run), run (one forward pass over all of
them, each token with its own adapter scales), postprocess (sample, detokenize,
stop, finish). Requests join and leave between steps.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import torch

from cache.prefix import PrefixCache
from worker.engine import prefix_kv
from worker.model.attention import KVCache, Segment
from worker.engine.outputs import GenerationResult, RequestOutput, TokenLogprob
from worker.engine.params import SamplingParams, slot_length
from worker.engine.runner import AdapterScales, ModelRunner
from worker.model.sampler import make_generator, sample
from worker.engine.scheduler import Chunk, Scheduler, Sequence
from worker.engine.stop import StopMatcher
from worker.formats.tokenizer import GGUFTokenizer, IncrementalDecoder

log = logging.getLogger(__name__)


class RequestError(ValueError):
    """The request cannot run as given (nothing was computed)."""


@dataclass(frozen=True)
class EngineConfig:
    num_slots: int = 16  # sequences decoding at once
    slot_len: int | None = None  # KV tokens per sequence (default: the context length, at most 2048)
    max_step_tokens: int = 256  # tokens per forward pass: prefill chunks fill what decoding leaves

    def __post_init__(self) -> None:
        if self.num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {self.num_slots}")
        if self.slot_len is not None and self.slot_len < 2:
            raise ValueError(f"slot_len must be >= 2, got {self.slot_len}")
        if self.max_step_tokens < self.num_slots:  # else decoding alone can use up every step
            raise ValueError(f"max_step_tokens ({self.max_step_tokens}) must be at least num_slots ({self.num_slots})")


@dataclass(frozen=True)
class EngineRequest:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    adapters: Mapping[int, float] = field(default_factory=dict)  # worker adapter slot -> scale
    cache_salt: str = ""  # the tenant's prefix-cache namespace (SPEC §5)
    cache_prompt: bool = True  # False: neither reuse nor store this request's KV
    tenant: str = ""  # whose request: the scheduler shares prompt tokens and free slots fairly between tenants


@dataclass(eq=False)
class _State:
    request: EngineRequest
    seq: Sequence
    scales: AdapterScales
    generator: torch.Generator
    decoder: IncrementalDecoder | None
    stop: StopMatcher
    result: GenerationResult
    arrived_s: float
    first_token_s: float | None = None
    cache: prefix_kv.CacheHit | None = None  # chunks still to load into the slot, and the store cursor

    def scale_rows(self, start: int, length: int) -> torch.Tensor:
        prompt = self.scales.prompt
        num_prompt = prompt.shape[0]
        parts = []
        if start < num_prompt:
            parts.append(prompt[start : min(start + length, num_prompt)])
        if start + length > num_prompt:
            parts.append(self.scales.generated.expand(start + length - max(start, num_prompt), -1))
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    @property
    def wants_prompt_logprobs(self) -> bool:
        return self.request.params.echo and self.request.params.logprobs is not None


def _logprob_entry(logprobs: torch.Tensor, token_id: int, k: int) -> TokenLogprob:
    top = torch.topk(logprobs, k) if k > 0 else None
    pairs = list(zip(top.indices.tolist(), top.values.tolist())) if top is not None else []
    return TokenLogprob(token_id, float(logprobs[token_id]), pairs)


class Engine:
    def __init__(
        self, runner: ModelRunner, tokenizer: GGUFTokenizer | None, config: EngineConfig | None = None,
        clock=time.perf_counter, prefix_cache: PrefixCache | None = None,
    ) -> None:
        self.runner, self.tokenizer = runner, tokenizer
        self.prefix_cache = prefix_cache
        if prefix_cache is not None and prefix_cache.geometry != prefix_kv.chunk_geometry(runner, prefix_cache.chunk_tokens):
            raise ValueError("the prefix cache was opened for another model, weight format or dtype")
        self.config = config = config or EngineConfig()
        self.slot_len = slot_length(config.slot_len, runner.hparams.context_length)
        self.cache: KVCache = runner.allocate_cache(config.num_slots, self.slot_len)
        self.scheduler = Scheduler(config.num_slots, self.slot_len, config.max_step_tokens)
        self.eog_ids = tokenizer.eog_ids if tokenizer is not None else frozenset()
        self._states: dict[str, _State] = {}
        self.clock = clock

    # requests in

    def check(self, request: EngineRequest) -> int:
        """Validate before any work; returns the KV positions the request needs."""
        return self._prepare(request)[0]

    def _prepare(self, request: EngineRequest) -> tuple[int, AdapterScales]:
        prompt, params = request.prompt_ids, request.params
        if not prompt:
            raise RequestError("the prompt is empty")
        if params.stop and self.tokenizer is None:
            raise RequestError("stop strings need the model's tokenizer, which is not supported here: use stop_token_ids")
        scales = self.runner.adapter_scales(prompt, request.adapters)  # slots exist, at most one aLoRA
        vocab = self.runner.hparams.vocab_size
        bad = [t for t in prompt if not 0 <= t < vocab]
        if bad:
            raise RequestError(f"prompt token id {bad[0]} is out of range (vocabulary size {vocab})")
        if params.max_tokens == -1:
            if len(prompt) >= self.slot_len:
                raise RequestError(f"the prompt ({len(prompt)} tokens) does not fit the context length ({self.slot_len})")
            return self.slot_len, scales
        if len(prompt) + params.max_tokens > self.slot_len:
            raise RequestError(
                f"the prompt ({len(prompt)} tokens) plus max_tokens ({params.max_tokens}) "
                f"exceeds the context length ({self.slot_len})"
            )
        return len(prompt) + params.max_tokens, scales

    def lookup(self, request: EngineRequest) -> prefix_kv.CacheHit | None:
        """The request's cached prefix (thread-safe, never raises: the cache only ever saves work).

        Call it off the engine's thread and pass the hit to `add_request`, so a
        Redis round trip never holds up the step loop.
        """
        if self.prefix_cache is None or not request.cache_prompt:
            return None
        try:
            activation = self.runner.alora_activation(request.prompt_ids, request.adapters)
            root = prefix_kv.request_root(self.runner, self.prefix_cache.geometry.model_id, request.adapters, request.cache_salt)
            wants_prompt_logprobs = request.params.echo and request.params.logprobs is not None  # every position is computed
            return prefix_kv.lookup(self.prefix_cache, root, request.prompt_ids, activation, reuse=not wants_prompt_logprobs)
        except Exception:
            log.exception("prefix cache lookup failed; running uncached")
            return None

    def add_request(self, request: EngineRequest, hit: prefix_kv.CacheHit | None = None, arrived_s: float | None = None) -> None:
        """Queue a request; `hit` from `lookup` (done here when not given), `arrived_s` on `clock`."""
        arrived_s = self.clock() if arrived_s is None else arrived_s
        if request.request_id in self._states:
            raise RequestError(f"request id {request.request_id!r} is already running")
        max_len, scales = self._prepare(request)
        if hit is None:
            hit = self.lookup(request)
        params = request.params
        seq = Sequence(request.request_id, list(request.prompt_ids), len(request.prompt_ids), max_len, group=request.tenant)
        seq.num_cached = hit.num_tokens if hit is not None else 0
        result = GenerationResult(list(request.prompt_ids), alora_activation=scales.alora_activation, cached_tokens=seq.num_cached)
        if params.logprobs is not None:
            result.logprobs = []
        state = _State(
            request, seq, scales, make_generator(params.seed, self.runner.config.torch_device),
            IncrementalDecoder(self.tokenizer) if self.tokenizer is not None else None,
            StopMatcher(params.stop), result, arrived_s, cache=hit,
        )
        self._states[request.request_id] = state
        self.scheduler.add(seq)

    def cancel(self, request_id: str) -> RequestOutput | None:
        """Stop a request now and free its KV slot; None when it is not here."""
        state = self._states.get(request_id)
        return None if state is None else self._finish(state, "cancelled")

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def result(self, request_id: str) -> GenerationResult | None:
        state = self._states.get(request_id)
        return None if state is None else state.result

    # one step

    def step(self) -> list[RequestOutput]:
        chunks = self.scheduler.schedule()
        if not chunks:
            return []
        try:
            self._load_cached(chunks)
            logits, rows = self._run(chunks)
        except Exception as e:  # the whole pass failed: fail its requests, keep serving
            log.exception("forward pass failed")
            return [self._finish(self._states[c.seq.request_id], "error", f"internal error: {e}") for c in chunks]
        outputs = []
        for chunk in chunks:
            state, slot = self._states[chunk.seq.request_id], chunk.seq.slot
            try:
                out = self._postprocess(state, chunk, logits, rows[chunk.seq.request_id])
            except Exception as e:  # one request's failure stays its own
                log.exception("request %s failed", chunk.seq.request_id)
                out = self._finish(state, "error", f"internal error: {e}")
            if out is None or out.finish_reason != "error":
                self._store_cached(state, slot)  # the slot still holds its KV, even if the request just finished
            if out is not None:
                outputs.append(out)
        return outputs

    def _load_cached(self, chunks: list[Chunk]) -> None:
        """Copy newly admitted sequences' cached prefixes into their slots."""
        for chunk in chunks:
            state = self._states[chunk.seq.request_id]
            if state.cache is not None and state.cache.chunks:
                prefix_kv.load_chunks(self.cache, chunk.seq.slot, state.cache.chunks)
                state.cache.chunks = []

    def _store_cached(self, state: _State, slot: int) -> None:
        """Hand the request's newly computed whole chunks to the prefix cache (never fails the request)."""
        if state.cache is None or self.prefix_cache is None:
            return
        cursor, seq = state.cache.cursor, state.seq
        first = cursor.num_chunks
        keys = prefix_kv.new_chunk_keys(cursor, seq.token_ids, seq.num_computed, self.prefix_cache.chunk_tokens)
        if not keys:
            return
        try:
            values = prefix_kv.extract_chunks(self.cache, slot, first, len(keys), self.prefix_cache.geometry)
            self.prefix_cache.store(list(zip(keys, values)))
        except Exception:
            log.exception("request %s: could not store its KV in the prefix cache", seq.request_id)
            self.prefix_cache.count_store_error(len(keys))
            state.cache = None

    def _run(self, chunks: list[Chunk]) -> tuple[torch.Tensor, dict[str, list[int]]]:
        token_ids: list[int] = []
        segments, scale_parts, logit_rows = [], [], []
        rows: dict[str, list[int]] = {}
        active: set[int] = set()
        for chunk in chunks:
            seq, state = chunk.seq, self._states[chunk.seq.request_id]
            row = len(token_ids)
            token_ids += seq.token_ids[chunk.start : chunk.start + chunk.length]
            segments.append(Segment(seq.slot, row, chunk.length, chunk.start))
            scale_parts.append(state.scale_rows(chunk.start, chunk.length))
            active |= state.scales.active_slots
            wanted = []
            if state.wants_prompt_logprobs and chunk.start < seq.num_prompt_tokens:
                wanted = list(range(row, row + min(chunk.length, seq.num_prompt_tokens - chunk.start)))
            if chunk.samples and (not wanted or wanted[-1] != row + chunk.length - 1):
                wanted.append(row + chunk.length - 1)
            rows[seq.request_id] = list(range(len(logit_rows), len(logit_rows) + len(wanted)))
            logit_rows += wanted
        scales = torch.cat(scale_parts) if len(scale_parts) > 1 else scale_parts[0]
        logits = self.runner.run(token_ids, segments, self.cache, scales, frozenset(active), logit_rows)
        return logits, rows

    def _postprocess(self, state: _State, chunk: Chunk, logits: torch.Tensor, rows: list[int]) -> RequestOutput | None:
        seq, params, result = state.seq, state.request.params, state.result
        seq.num_computed += chunk.length
        if state.wants_prompt_logprobs and chunk.start < seq.num_prompt_tokens:
            self._prompt_logprobs(state, chunk, logits, rows)
        if not chunk.samples:
            return None
        if len(result.token_ids) >= seq.max_len - seq.num_prompt_tokens:  # max_tokens 0
            return self._finish(state, "length")
        row = logits[rows[-1]]
        if state.first_token_s is None:
            state.first_token_s = self.clock()
        masked = row
        if params.ignore_eos and self.eog_ids:
            masked = row.clone()
            masked[sorted(self.eog_ids)] = float("-inf")
        token = sample(masked, params, state.generator)
        if token in self.eog_ids or token in params.stop_token_ids:
            return self._finish(state, "stop")
        seq.token_ids.append(token)
        result.token_ids.append(token)
        entry = None
        if params.logprobs is not None:
            entry = _logprob_entry(torch.log_softmax(row, dim=-1), token, params.logprobs)
            result.logprobs.append(entry)
        text = state.stop.feed(state.decoder.push(token)) if state.decoder is not None else ""
        result.text += text
        if state.stop.is_stopped:
            return self._finish(state, "stop", delta=([token], text, entry))
        if len(seq.token_ids) >= seq.max_len:
            return self._finish(state, "length", delta=([token], text, entry))
        return RequestOutput(seq.request_id, [token], text, [entry] if entry else None)

    def _prompt_logprobs(self, state: _State, chunk: Chunk, logits: torch.Tensor, rows: list[int]) -> None:
        seq, k = state.seq, state.request.params.logprobs
        result = state.result
        if result.prompt_logprobs is None:
            result.prompt_logprobs = [None]
        num = min(chunk.length, seq.num_prompt_tokens - chunk.start)
        lp = torch.log_softmax(logits[rows[0] : rows[0] + num], dim=-1)  # the model's own distribution
        for i in range(num):
            position = chunk.start + i + 1  # row i predicts this prompt token
            if position < seq.num_prompt_tokens:
                result.prompt_logprobs.append(_logprob_entry(lp[i], seq.token_ids[position], k))

    def _finish(self, state: _State, reason: str, error: str | None = None, delta: tuple | None = None) -> RequestOutput:
        token_ids, text, entry = delta or ([], "", None)
        if reason in ("stop", "length") and state.decoder is not None:
            tail = state.stop.feed(state.decoder.flush()) + state.stop.flush()
            text += tail
            state.result.text += tail
            if state.stop.is_stopped:  # the last character completed a stop string
                reason = "stop"
        result = state.result
        result.finish_reason, result.error = reason, error
        now = self.clock()
        first = now if state.first_token_s is None else state.first_token_s
        result.prompt_time_s, result.decode_time_s = first - state.arrived_s, now - first
        self.scheduler.finish(state.seq)
        del self._states[state.seq.request_id]
        return RequestOutput(state.seq.request_id, token_ids, text, [entry] if entry else None, reason, error, result)

    # convenience

    def run_all(self, requests: Iterable[EngineRequest]) -> dict[str, GenerationResult]:
        """Run requests together to completion (they batch with each other)."""
        results: dict[str, GenerationResult] = {}
        for request in requests:
            self.add_request(request)
            results[request.request_id] = self._states[request.request_id].result
        while self.has_work():
            self.step()
        return results
