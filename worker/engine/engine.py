"""The worker engine: continuous batching of requests with different adapter sets.

A step is: schedule (which tokens of which sequences run), run (one forward pass
over all of them, each token with its own adapter scales, and every next token
sampled at once), postprocess (detokenize, stop, finish). The prefix cache sits
beside the step: cached prefixes are loaded into newly admitted sequences' KV
slots before the pass, newly computed chunks stored after it. Requests join and
leave between steps.

A request asking for n choices prefills its prompt once: its other choices
sample their first tokens from the same logits and get a copy of the prompt's
KV in their own slots (see the scheduler). Each choice then decodes, stops and
finishes on its own; a choice that fails, or a cancel, ends them all.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from cache.prefix import PrefixCache
from worker.contract.params import SamplingParams
from worker.contract.spec import EngineConfig, slot_length
from worker.engine.constraint import GrammarRefused, Grammars, allowed_tokens
from worker.engine.decode_threads import DecodeThreads
from worker.engine.outputs import EngineCounters, GenerationResult, RequestOutput
from worker.engine.prefix_kv import CacheHit, PrefixKV
from worker.engine.runner import ModelRunner, SpanInput, SpanOutput
from worker.engine.scheduler import Scheduler, Span
from worker.engine.sequence import Sequence
from worker.engine.step_costs import StepCosts
from worker.engine.stop import StopMatcher
from worker.formats.tokenizer import GGUFTokenizer, IncrementalDecoder
from worker.lora.mapping import RequestAdapters
from worker.model.sampler import SampleSpec, make_generator

log = logging.getLogger(__name__)


class RequestError(ValueError):
    """The request cannot run as given (nothing was computed)."""


@dataclass(frozen=True)
class EngineRequest:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    adapters: Mapping[int, float] = field(default_factory=dict)  # adapter slot -> scale
    cache_salt: str = ""  # the tenant's prefix-cache namespace (SPEC §5)
    cache_prompt: bool = True  # False: neither reuse nor store this request's KV
    tenant: str = ""  # whose request: the scheduler shares prompt tokens and free slots fairly between tenants
    timeout_s: float | None = None  # its deadline, from arrival: past it, the request ends (Engine.expire)


@dataclass(eq=False)
class _State:
    request: EngineRequest
    seq: Sequence
    adapters: RequestAdapters
    generator: torch.Generator
    decoder: IncrementalDecoder | None
    stop: StopMatcher
    result: GenerationResult
    arrived_s: float
    first_step_s: float | None = None
    first_token_s: float | None = None
    matcher: Any = None  # llguidance.LLMatcher of a request with a grammar

    @property
    def key(self) -> tuple[str, int]:
        return self.seq.key

    @property
    def deadline_s(self) -> float | None:
        return None if self.request.timeout_s is None else self.arrived_s + self.request.timeout_s

    @property
    def wants_prompt_logprobs(self) -> bool:
        return self.request.params.echo and self.request.params.logprobs is not None

    @property
    def is_at_limit(self) -> bool:
        """No token may be added (max_tokens 0)."""
        return len(self.result.token_ids) >= self.seq.max_len - self.seq.num_prompt_tokens


class Engine:
    def __init__(
        self, runner: ModelRunner, tokenizer: GGUFTokenizer | None, config: EngineConfig | None = None,
        clock=time.perf_counter, prefix_cache: PrefixCache | None = None,
    ) -> None:
        self.runner, self.tokenizer = runner, tokenizer
        self.prefix = PrefixKV(prefix_cache, runner) if prefix_cache is not None else None
        self.config = config = config or EngineConfig()
        self.slot_len = slot_length(config.slot_len, runner.hparams.context_length)
        self.kv = runner.allocate_kv(config.num_seq_slots, self.slot_len)
        self.scheduler = Scheduler(config.num_seq_slots, self.slot_len, config.max_step_tokens, config.reserved_slots, config.is_multi_tenant)
        decode_threads = runner.config.decode_threads
        self.threads = None if runner.max_threads is None else DecodeThreads(
            runner.max_threads, None if decode_threads == "auto" else decode_threads or runner.max_threads)
        self.costs = StepCosts()  # measured: each step's prefill_while_decoding, the floor or more (decode_stall)
        self.eog_ids = tokenizer.eog_ids if tokenizer is not None else frozenset()
        self._eog_sorted = tuple(sorted(self.eog_ids))
        self.grammars = Grammars(tokenizer, runner.hparams.vocab_size)
        self._states: dict[tuple[str, int], _State] = {}  # by sequence key: request id and choice
        self._requests: dict[str, list[_State]] = {}  # request id -> its choices still running
        self.counters = EngineCounters()
        self.clock = clock

    # requests in

    def check(self, request: EngineRequest) -> int:
        """Validate before any work; returns the KV positions the request needs. A grammar is
        compiled here (the engine loop calls this off its thread), so `add_request` finds it cached."""
        needed = self._prepare(request)[0]
        if request.params.grammar is not None:
            try:
                self.grammars.compile(request.params.grammar)
            except GrammarRefused as e:
                raise RequestError(str(e)) from e
        return needed

    def _prepare(self, request: EngineRequest) -> tuple[int, RequestAdapters]:
        prompt, params = request.prompt_ids, request.params
        if not prompt:
            raise RequestError("the prompt is empty")
        if params.n > self.config.num_seq_slots:
            raise RequestError(f"n ({params.n}) is more than this worker's {self.config.num_seq_slots} sequence slots")
        if params.stop and self.tokenizer is None:
            raise RequestError("stop strings need the model's tokenizer, which is not supported here: use stop_token_ids")
        adapters = self.runner.resolve_adapters(prompt, request.adapters)  # slots exist, at most one aLoRA
        vocab = self.runner.hparams.vocab_size
        bad = [t for t in prompt if not 0 <= t < vocab]
        if bad:
            raise RequestError(f"prompt token id {bad[0]} is out of range (vocabulary size {vocab})")
        bad = [t for t, _ in params.logit_bias if t >= vocab]
        if bad:  # the gateway checks too; here it keeps a bad one from failing a whole pass
            raise RequestError(f"logit_bias token id {bad[0]} is out of range (vocabulary size {vocab})")
        if params.max_tokens == -1:
            if len(prompt) >= self.slot_len:
                raise RequestError(f"the prompt ({len(prompt)} tokens) does not fit the context length ({self.slot_len})")
            return self.slot_len, adapters
        if len(prompt) + params.max_tokens > self.slot_len:
            raise RequestError(
                f"the prompt ({len(prompt)} tokens) plus max_tokens ({params.max_tokens}) "
                f"exceeds the context length ({self.slot_len})"
            )
        return len(prompt) + params.max_tokens, adapters

    def lookup(self, request: EngineRequest) -> CacheHit | None:
        """The request's cached prefix (thread-safe, never raises: the cache only ever saves work).

        Call it off the engine's thread and pass the hit to `add_request`, so a
        Redis round trip never holds up the step loop.
        """
        if self.prefix is None or not request.cache_prompt:
            return None
        try:
            adapters = self.runner.resolve_adapters(request.prompt_ids, request.adapters)
            wants_prompt_logprobs = request.params.echo and request.params.logprobs is not None  # every position is computed
            return self.prefix.lookup(request.prompt_ids, adapters, request.cache_salt, reuse=not wants_prompt_logprobs)
        except Exception:
            log.exception("prefix cache lookup failed; running uncached")
            return None

    def add_request(self, request: EngineRequest, hit: CacheHit | None = None, arrived_s: float | None = None) -> None:
        """Queue a request; `hit` from `lookup` (done here when not given), `arrived_s` on `clock`."""
        arrived_s = self.clock() if arrived_s is None else arrived_s
        if request.request_id in self._requests:
            raise RequestError(f"request id {request.request_id!r} is already running")
        max_len, adapters = self._prepare(request)
        if hit is None:
            hit = self.lookup(request)
        num_cached = hit.num_tokens if hit is not None else 0
        try:
            choices = [self._new_state(request, i, max_len, adapters, num_cached, arrived_s) for i in range(request.params.n)]
        except GrammarRefused as e:
            raise RequestError(str(e)) from e
        leader = choices[0].seq
        leader.num_cached = num_cached
        for state in choices[1:]:
            state.seq.fork_of = leader
            leader.forks.append(state.seq)
        for state in choices:
            self._states[state.key] = state
        self._requests[request.request_id] = choices
        if hit is not None and self.prefix is not None:
            self.prefix.track(leader.key, hit)
        self.scheduler.add(leader)

    def _new_state(self, request: EngineRequest, index: int, max_len: int, adapters: RequestAdapters, num_cached: int, arrived_s: float) -> _State:
        params = request.params
        seq = Sequence(request.request_id, list(request.prompt_ids), len(request.prompt_ids), max_len, group=request.tenant, index=index)
        result = GenerationResult(list(request.prompt_ids), alora_activation=adapters.activation, cached_tokens=num_cached)
        if params.logprobs is not None:
            result.logprobs = []
        return _State(
            request, seq, adapters, make_generator(params.choice_seed(index), self.runner.config.torch_device),
            IncrementalDecoder(self.tokenizer) if self.tokenizer is not None else None,
            StopMatcher(params.stop), result, arrived_s,
            matcher=self.grammars.matcher(params.grammar) if params.grammar is not None else None,
        )

    def cancel(self, request_id: str) -> RequestOutput | None:
        """Stop a request (every choice) now and free its KV slots; None when it is not here."""
        choices = self._requests.get(request_id)
        return None if not choices else self._finish(choices[0], "cancelled")

    def adapter_slots_in_use(self) -> set[int]:
        """Adapter slots some running or waiting request uses (one that is not may be removed)."""
        return {slot for state in self._states.values() for slot in state.request.adapters}

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def expire(self) -> list[RequestOutput]:
        """End the requests past their deadline: 503 when one never got a first token (the
        worker was too busy), 504 once it had started."""
        now = self.clock()
        late = [choices[0] for choices in self._requests.values() if choices[0].deadline_s is not None and now >= choices[0].deadline_s]
        return [
            self._finish(s, "error", f"the request did not finish within its deadline of {s.request.timeout_s:g} s",
                         status=504 if s.first_token_s is not None else 503)
            for s in late
        ]

    def result(self, request_id: str, index: int = 0) -> GenerationResult | None:
        state = self._states.get((request_id, index))
        return None if state is None else state.result

    # one step

    def step(self) -> list[RequestOutput]:
        self.scheduler.prefill_while_decoding = self.costs.prompt_budget(self.config.prefill_while_decoding, self.config.decode_stall)
        spans = self.scheduler.schedule()
        if not spans:
            return []
        now = self.clock()
        for span in spans:
            state = self._states[span.seq.key]
            if state.first_step_s is None:
                state.first_step_s = now
        position = {span.seq: i for i, span in enumerate(spans)}
        prompt_tokens = sum(span.prompt_tokens for span in spans)
        try:
            if self.prefix is not None:
                self.prefix.load(spans, self.kv)
            num_decode = sum(span.length for span in spans) - prompt_tokens
            threads = self.threads.choose(prompt_tokens) if self.threads is not None else None
            if threads is not None:
                self.runner.use_threads(threads)
            started = self.clock()
            outputs = self.runner.run([self._span_input(span, position) for span in spans], self.kv)
            seconds = self.clock() - started
            self.costs.observe(num_decode, prompt_tokens, seconds)
            if threads is not None:
                self.threads.observe(threads, num_decode, prompt_tokens, seconds)
        except Exception as e:  # the whole pass failed: fail its requests, keep serving
            log.exception("forward pass failed")
            return [self._finish(state, "error", f"internal error: {e}", status=500) for state in self._live(spans)]
        self.counters.step(prompt_tokens, seconds)
        for span in spans:
            seq = span.seq
            seq.num_computed += span.length
            if span.fork_of is not None:  # a fork takes the prompt's KV, computed once
                self.kv.copy_prefix(span.fork_of.seq_slot, seq.seq_slot, span.start)
                self.counters.forked_prompt_tokens += span.start
        if self.prefix is not None:
            self.prefix.store(spans, self.kv)  # the slots hold the new KV, even of requests finishing below
        return self._postprocess(spans, outputs)

    def _live(self, spans: list[Span]) -> Iterable[_State]:
        """The states of the spans' sequences, skipping those a failed choice of theirs has ended."""
        for span in spans:
            state = self._states.get(span.seq.key)
            if state is not None:
                yield state

    def _span_input(self, span: Span, position: Mapping[Sequence, int]) -> SpanInput:
        state, seq = self._states[span.seq.key], span.seq
        params = state.request.params
        sample = None
        if span.samples and not state.is_at_limit:
            sample = SampleSpec(params, state.generator, self._eog_sorted if params.ignore_eos else (),
                                params.penalty_window(seq.token_ids, seq.num_prompt_tokens),
                                allowed_tokens(state.matcher) if state.matcher is not None else None)
        targets: list[int] = []
        if state.wants_prompt_logprobs and span.start < seq.num_prompt_tokens:  # row i predicts prompt token start + i + 1
            targets = seq.token_ids[span.start + 1 : min(span.start + span.length + 1, seq.num_prompt_tokens)]
        return SpanInput(seq.seq_slot, span.start, seq.token_ids[span.start : span.start + span.length], state.adapters,
                         sample, params.logprobs, targets, None if span.fork_of is None else position[span.fork_of])

    def _postprocess(self, spans: list[Span], outputs: list[SpanOutput]) -> list[RequestOutput]:
        deltas = []
        for span, out in zip(spans, outputs):
            state = self._states.get(span.seq.key)
            if state is None:  # a choice of the same request failed earlier in this step, ending it
                continue
            try:
                delta = self._advance(state, span, out)
            except Exception as e:  # one request's failure stays its own
                log.exception("request %s (choice %d) failed", span.seq.request_id, span.seq.index)
                delta = self._finish(state, "error", f"internal error: {e}", status=500)
            if delta is not None:
                deltas.append(delta)
        return deltas

    def _advance(self, state: _State, span: Span, out: SpanOutput) -> RequestOutput | None:
        seq, params, result = state.seq, state.request.params, state.result
        if out.prompt_logprobs:
            if result.prompt_logprobs is None:
                result.prompt_logprobs = [None]
            result.prompt_logprobs += out.prompt_logprobs
        if not span.samples:
            return None
        if state.is_at_limit:  # max_tokens 0
            return self._finish(state, "length")
        if out.nothing_allowed:
            return self._finish(state, "error", "no token may come next: this request's grammar, logit_bias and ignore_eos together allow none",
                                status=400)
        if not out.is_finite:
            return self._finish(state, "error", "the model's output for this request is not finite (are its adapter scales too large?)", status=400)
        if state.first_token_s is None:
            state.first_token_s = self.clock()
        token = out.token
        if token in self.eog_ids or token in params.stop_token_ids:
            result.stop_logprob = out.logprob.logprob if out.logprob is not None else None  # of the token not returned
            return self._finish(state, "stop")
        if state.matcher is not None and not state.matcher.consume_token(token):
            return self._finish(state, "error", f"internal error: the grammar refused token {token}: {state.matcher.get_error()}", status=500)
        seq.token_ids.append(token)
        result.token_ids.append(token)
        self.counters.generated_tokens += 1
        if out.logprob is not None:
            result.logprobs.append(out.logprob)
        text = state.stop.feed(state.decoder.push(token)) if state.decoder is not None else ""
        result.text += text
        delta = ([token], text, out.logprob)
        if state.stop.is_stopped or (state.matcher is not None and state.matcher.is_stopped()):  # the grammar is complete
            return self._finish(state, "stop", delta=delta)
        if len(seq.token_ids) >= seq.max_len:
            return self._finish(state, "length", delta=delta)
        return RequestOutput(seq.request_id, [token], text, [out.logprob] if out.logprob else None, index=seq.index)

    def _finish(self, state: _State, reason: str, error: str | None = None, delta: tuple | None = None, status: int | None = None) -> RequestOutput:
        """End one choice; a cancel or an error ends the request's other choices first (without
        outputs of their own), so the output returned is the request's last."""
        token_ids, text, entry = delta or ([], "", None)
        if reason in ("stop", "length") and state.decoder is not None:
            tail = state.stop.feed(state.decoder.flush()) + state.stop.flush()
            text += tail
            state.result.text += tail
            if state.stop.is_stopped:  # the last character completed a stop string
                reason = "stop"
        if reason in ("cancelled", "error"):
            for other in list(self._requests.get(state.seq.request_id, ())):
                if other is not state:
                    self._retire(other, "cancelled")
        self._retire(state, reason, error, status)
        left = len(self._requests.get(state.seq.request_id, ()))
        return RequestOutput(state.seq.request_id, token_ids, text, [entry] if entry else None, reason, error, state.result, state.seq.index, left)

    def _retire(self, state: _State, reason: str, error: str | None = None, status: int | None = None) -> None:
        """Record a choice's end and free its slot."""
        result = state.result
        result.finish_reason, result.error, result.error_status = reason, error, status
        result.stop_word = state.stop.matched
        now = self.clock()
        first = now if state.first_token_s is None else state.first_token_s
        result.prompt_time_s, result.decode_time_s = first - state.arrived_s, now - first
        result.queue_time_s = (state.first_step_s or now) - state.arrived_s
        self.scheduler.finish(state.seq)
        if self.prefix is not None:
            self.prefix.forget(state.key)
        del self._states[state.key]
        choices = self._requests[state.seq.request_id]
        choices.remove(state)
        if not choices:
            del self._requests[state.seq.request_id]

    # convenience

    def run_all(self, requests: Iterable[EngineRequest]) -> dict[str, GenerationResult]:
        """Run requests together to completion (they batch with each other)."""
        results: dict[str, GenerationResult] = {}
        for request in requests:
            self.add_request(request)
            results[request.request_id] = self._states[(request.request_id, 0)].result
        while self.has_work():
            self.step()
        return results
