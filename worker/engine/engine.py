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

from cache.prefix import PrefixCache
from worker.contract.calls import Delta, TokenLogprob
from worker.contract.spec import EngineConfig, slot_length
from worker.engine.constraint import GrammarRefused, Grammars, allowed_tokens
from worker.engine.decode_threads import DecodeThreads
from worker.engine.outputs import EngineCounters, GenerationResult, StepTokens
from worker.engine.prefix_kv import CacheHit, PrefixKV
from worker.engine.request import CheckedRequest, Choice, EngineRequest, RequestError, kv_positions
from worker.engine.runner import ModelRunner, SpanInput, SpanOutput
from worker.engine.scheduler import Scheduler, Span
from worker.engine.sequence import SequenceState
from worker.engine.speculative.speculator import draft_samples, open_speculator
from worker.engine.speculative.verify import DraftedSpan
from worker.engine.step_costs import StepCosts
from worker.engine.stop import StopMatcher
from worker.formats.tokenizer import GGUFTokenizer, IncrementalDecoder
from worker.model.sampler import SampleSpec, make_generator

log = logging.getLogger(__name__)


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
        self.scheduler = Scheduler(config.num_seq_slots, self.slot_len, config.max_step_tokens, config.reserved_slots,
                                   config.is_multi_tenant)
        decode_threads = runner.config.decode_threads
        self.threads = None if runner.max_threads is None else DecodeThreads(
            runner.max_threads, None if decode_threads == "auto" else decode_threads or runner.max_threads)
        self.costs = StepCosts()  # measured: each step's prefill_while_decoding, the floor or more (decode_stall)
        self.eog_ids = tokenizer.eog_ids if tokenizer is not None else frozenset()
        self._eog_sorted = tuple(sorted(self.eog_ids))
        self.grammars = Grammars(tokenizer, runner.hparams.vocab_size)
        self._choices: dict[tuple[str, int], Choice] = {}  # by sequence key: request id and choice
        self._requests: dict[str, list[Choice]] = {}  # request id -> its choices still running
        self.counters = EngineCounters()
        self.clock = clock
        self.speculator = open_speculator(config.speculative, runner, config.num_seq_slots, self.slot_len, tokenizer)
        self._drafted: dict[tuple[str, int], DraftedSpan] = {}  # this step's speculative spans, by sequence key

    # requests in

    def check(self, request: EngineRequest) -> CheckedRequest:
        """Check what only this engine knows (its KV slots, their length, the adapter slots it
        holds), resolve the adapters once, and compile a grammar (the engine loop calls this off
        its thread, so `add_request` finds it cached). The rest the gateway checked (docs/architecture.md#bounded-work:
        token ids within the vocabulary, the model's context, the number of choices)."""
        prompt, params = request.prompt_ids, request.params
        if not prompt:  # nothing to compute logits from
            raise RequestError("the prompt is empty")
        if params.n > self.config.num_seq_slots:
            raise RequestError(f"n ({params.n}) is more than this worker's {self.config.num_seq_slots} sequence slots")
        if params.stop and self.tokenizer is None:
            raise RequestError("stop strings need the model's tokenizer, which is not supported here: use stop_token_ids")
        max_len = kv_positions(len(prompt), params.max_tokens, self.slot_len)
        adapters = self.runner.resolve_adapters(prompt, request.scales_by_slot)  # slots held, at most one aLoRA
        if params.grammar is not None:
            try:
                self.grammars.compile(params.grammar)
            except GrammarRefused as e:
                raise RequestError(str(e)) from e
        return CheckedRequest(request, max_len, adapters)

    def lookup(self, checked: CheckedRequest) -> CacheHit | None:
        """The request's cached prefix (thread-safe, never raises: the cache only ever saves work).

        Call it off the engine's thread and pass the hit to `add_request`, so a
        Redis round trip never holds up the step loop.
        """
        request = checked.request
        if self.prefix is None or not request.cache_prompt:
            return None
        try:
            wants_prompt_logprobs = request.params.echo and request.params.logprobs is not None  # every position is computed
            return self.prefix.lookup(request.prompt_ids, checked.adapters, request.cache_salt, reuse=not wants_prompt_logprobs)
        except Exception:
            log.exception("prefix cache lookup failed; running uncached")
            return None

    def add_request(self, request: EngineRequest | CheckedRequest, hit: CacheHit | None = None, arrived_s: float | None = None) -> None:
        """Queue a request: checked (`check`) with its `hit` (`lookup`), or as it is (both done
        here); `arrived_s` on `clock`."""
        arrived_s = self.clock() if arrived_s is None else arrived_s
        checked = request if isinstance(request, CheckedRequest) else None
        request = request.request if checked is not None else request
        if request.request_id in self._requests:
            raise RequestError(f"request id {request.request_id!r} is already running")
        if checked is None:
            checked = self.check(request)
            hit = self.lookup(checked)
        num_cached = hit.num_tokens if hit is not None else 0
        try:
            choices = [self._new_choice(checked, i, num_cached, arrived_s) for i in range(request.params.n)]
        except GrammarRefused as e:
            raise RequestError(str(e)) from e
        leader = choices[0].seq
        leader.num_cached = num_cached
        for choice in choices[1:]:
            choice.seq.fork_of = leader
            leader.forks.append(choice.seq)
        for choice in choices:
            self._choices[choice.key] = choice
        self._requests[request.request_id] = choices
        if hit is not None and self.prefix is not None:
            self.prefix.track(leader.key, hit)
        self.scheduler.add(leader)

    def _new_choice(self, checked: CheckedRequest, index: int, num_cached: int, arrived_s: float) -> Choice:
        request, params = checked.request, checked.request.params
        seq = SequenceState(request.request_id, list(request.prompt_ids), len(request.prompt_ids), checked.max_len,
                            tenant=request.tenant, index=index)
        result = GenerationResult(list(request.prompt_ids), alora_activation=checked.adapters.activation, cached_tokens=num_cached)
        if params.logprobs is not None:
            result.logprobs = []
        return Choice(
            request, seq, checked.adapters, make_generator(params.choice_seed(index), self.runner.config.torch_device),
            IncrementalDecoder(self.tokenizer) if self.tokenizer is not None else None,
            StopMatcher(params.stop), result, arrived_s,
            matcher=self.grammars.matcher(params.grammar) if params.grammar is not None else None,
        )

    def cancel(self, request_id: str) -> Delta | None:
        """Stop a request (every choice) now and free its KV slots; None when it is not here."""
        choices = self._requests.get(request_id)
        return None if not choices else self._finish(choices[0], "cancelled")

    def adapter_slots_in_use(self) -> set[int]:
        """Adapter slots some running or waiting request uses (one that is not may be removed)."""
        return {slot for choice in self._choices.values() for slot in choice.request.scales_by_slot}

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def expire(self) -> list[Delta]:
        """End the requests past their deadline: 503 when one never got a first token (the
        worker was too busy), 504 once it had started."""
        now = self.clock()
        late = [choices[0] for choices in self._requests.values() if choices[0].deadline_s is not None and now >= choices[0].deadline_s]
        return [
            self._finish(c, "error", error=f"the request did not finish within its deadline of {c.request.timeout_s:g} s",
                         status=504 if c.first_token_s is not None else 503)
            for c in late
        ]

    def result(self, request_id: str, index: int = 0) -> GenerationResult | None:
        choice = self._choices.get((request_id, index))
        return None if choice is None else choice.result

    # one step

    def step(self) -> list[Delta]:
        """Schedule, run, postprocess: one forward pass over every scheduled span, and what it
        added to each request."""
        self.scheduler.prefill_while_decoding = self.costs.prompt_budget(self.config.prefill_while_decoding, self.config.decode_stall)
        spans = self.scheduler.schedule()
        if not spans:
            return []
        if self.speculator is not None:
            spans = self.speculator.draft(spans, self._choices, self._drafted, self.config.max_step_tokens)
        try:
            outputs = self._run(spans)
        except Exception as e:  # the whole pass failed: fail its requests, keep serving
            log.exception("forward pass failed")
            return [self._finish(choice, "error", error=f"internal error: {e}", status=500) for choice in self._live(spans)]
        return self._postprocess(spans, outputs)

    def _run(self, spans: list[Span]) -> list[SpanOutput]:
        """The pass, with what goes around it: cached prefixes loaded before, the thread count
        chosen; after, its cost measured, forks given their prompt's KV, new chunks stored."""
        now = self.clock()
        for span in spans:
            choice = self._choices[span.seq.key]
            if choice.first_step_s is None:
                choice.first_step_s = now
        prompt_tokens = sum(span.prompt_tokens for span in spans)
        num_decode = sum(span.length for span in spans) - prompt_tokens
        if self.prefix is not None:
            self.prefix.load(spans, self.kv)
        threads = self.threads.choose(prompt_tokens) if self.threads is not None else None
        if threads is not None:
            self.runner.use_threads(threads)
        position = {span.seq: i for i, span in enumerate(spans)}
        started, cpu_started = self.clock(), time.thread_time()
        outputs = self.runner.run([self._span_input(span, position) for span in spans], self.kv)
        seconds = self.clock() - started
        self.costs.observe(num_decode, prompt_tokens, seconds)  # drafts are not decoded tokens: they do not count
        if self.speculator is not None and prompt_tokens == 0:
            self.speculator.costs.observe(num_decode, sum(len(span.drafts) for span in spans), seconds)
        if threads is not None:
            self.threads.observe(threads, num_decode, prompt_tokens, seconds)
        self.counters.step(prompt_tokens, seconds, time.thread_time() - cpu_started)
        for span in spans:
            seq = span.seq
            seq.num_computed += span.length
            if span.fork_of is not None:  # a fork takes the prompt's KV, computed once
                self.kv.copy_prefix(span.fork_of.seq_slot, seq.seq_slot, span.start)
                self.counters.forked_prompt_tokens += span.start
        if self.prefix is not None:
            self.prefix.store(spans, self.kv)  # the slots hold the new KV, even of requests finishing below
        return outputs

    def _live(self, spans: list[Span]) -> Iterable[Choice]:
        """The choices of the spans' sequences, skipping those a failed choice of theirs has ended."""
        for span in spans:
            choice = self._choices.get(span.seq.key)
            if choice is not None:
                yield choice

    def _span_input(self, span: Span, position: Mapping[SequenceState, int]) -> SpanInput:
        choice, seq = self._choices[span.seq.key], span.seq
        params = choice.request.params
        sample = None
        if span.samples and not choice.is_at_limit:
            sample = SampleSpec(params, choice.generator, self._eog_sorted if params.ignore_eos else (),
                                params.penalty_window(seq.token_ids, seq.num_prompt_tokens),
                                allowed_tokens(choice.matcher) if choice.matcher is not None else None)
        targets: list[int] = []
        if choice.wants_prompt_logprobs and span.start < seq.num_prompt_tokens:  # row i predicts prompt token start + i + 1
            targets = seq.token_ids[span.start + 1 : min(span.start + span.length + 1, seq.num_prompt_tokens)]
        drafted, verifying = self._drafted.get(seq.key), ()
        if drafted is not None and sample is not None:
            *verifying, sample = draft_samples(sample, seq.token_ids, seq.num_prompt_tokens, drafted)
        token_ids = seq.token_ids[span.start : span.start + span.length]
        token_ids += span.drafts
        return SpanInput(seq.seq_slot, span.start, token_ids,
                         choice.adapters, sample, params.logprobs, targets, None if span.fork_of is None else position[span.fork_of],
                         tuple(verifying))

    def _postprocess(self, spans: list[Span], outputs: list[SpanOutput]) -> list[Delta]:
        deltas = []
        for span, out in zip(spans, outputs):
            choice = self._choices.get(span.seq.key)
            if choice is None:  # a choice of the same request failed earlier in this step, ending it
                continue
            try:
                delta = self._advance(choice, span, out)
            except Exception as e:  # one request's failure stays its own
                log.exception("request %s (choice %d) failed", span.seq.request_id, span.seq.index)
                delta = self._finish(choice, "error", error=f"internal error: {e}", status=500)
            if delta is not None:
                deltas.append(delta)
        return deltas

    def _advance(self, choice: Choice, span: Span, out: SpanOutput) -> Delta | None:
        """What the pass's output `out` adds to `choice`: its next token, or its end."""
        seq, result = choice.seq, choice.result
        if out.prompt_logprobs:
            if result.prompt_logprobs is None:
                result.prompt_logprobs = [None]
            result.prompt_logprobs += out.prompt_logprobs
        if not span.samples:
            return None
        if choice.is_at_limit:  # max_tokens 0
            return self._finish(choice, "length")
        drafted = self._drafted.pop(seq.key, None)
        drafts = drafted.drafts if drafted is not None else ()
        result.num_drafted += len(drafts)
        self.counters.drafted_tokens += len(drafts)
        taken = StepTokens()
        for j, pick in enumerate([*out.verified, out]):  # the token picked at the last token, then after each draft
            if j and (pick.nothing_allowed or not pick.is_finite):  # decoding this position next step ends the request
                break
            if pick.nothing_allowed:
                return self._finish(choice, "error", error="no token may come next: this request's grammar, logit_bias and "
                                    "ignore_eos together allow none", status=400)
            if not pick.is_finite:
                return self._finish(choice, "error", status=400,
                                    error="the model's output for this request is not finite (are its adapter scales too large?)")
            if choice.first_token_s is None:
                choice.first_token_s = self.clock()
            is_accepted = j < len(drafts) and pick.token == drafts[j]
            if is_accepted:
                taken.num_accepted += 1
                result.num_draft_accepted += 1
                self.counters.accepted_draft_tokens += 1
            end = self._take(choice, pick.token, pick.logprob, taken)
            if end is not None or not is_accepted:
                return end or self._verified(choice, drafted, taken)
        return self._verified(choice, drafted, taken)

    def _take(self, choice: Choice, token: int, logprob: TokenLogprob | None, taken: StepTokens) -> Delta | None:
        """Add `token` to the choice (to `taken`, this step's); its end, when the token ends it."""
        seq, result = choice.seq, choice.result
        if token in self.eog_ids or token in choice.request.params.stop_token_ids:
            result.stop_logprob = logprob.logprob if logprob is not None else None  # of the token not returned
            return self._finish(choice, "stop", *taken.delta_fields())
        if choice.matcher is not None and not choice.matcher.consume_token(token):
            return self._finish(choice, "error", error=f"internal error: the grammar refused token {token}: "
                                f"{choice.matcher.get_error()}", status=500)
        seq.token_ids.append(token)
        seq.num_computed = len(seq.token_ids) - 1  # its tokens' KV is in the slot (a rejected draft's is past it)
        result.token_ids.append(token)
        self.counters.generated_tokens += 1
        if logprob is not None:
            result.logprobs.append(logprob)
            taken.logprobs.append(logprob)
        piece = choice.stop.feed(choice.decoder.push(token)) if choice.decoder is not None else ""
        result.text += piece
        taken.token_ids.append(token)
        taken.text += piece
        if choice.stop.is_stopped or (choice.matcher is not None and choice.matcher.is_stopped()):  # the grammar is complete
            return self._finish(choice, "stop", *taken.delta_fields())
        if len(seq.token_ids) >= seq.max_len:
            return self._finish(choice, "length", *taken.delta_fields())
        return None

    def _verified(self, choice: Choice, drafted: DraftedSpan | None, taken: StepTokens) -> Delta:
        """The step's tokens for a choice that goes on (after a speculative span, what it taught)."""
        if drafted is not None:
            self.speculator.verified(choice, drafted, taken, self.scheduler)
        return Delta(*taken.delta_fields(), index=choice.seq.index, request_id=choice.seq.request_id)

    def _finish(self, choice: Choice, reason: str, token_ids: tuple[int, ...] = (), text: str = "",
                logprobs: tuple[TokenLogprob, ...] | None = None, *, error: str | None = None, status: int | None = None) -> Delta:
        """End one choice, with the last of its new tokens; a cancel or an error ends the
        request's other choices first (without deltas of their own), so the delta returned is the
        request's last. It carries the choice's summary."""
        if reason in ("stop", "length") and choice.decoder is not None:
            tail = choice.stop.feed(choice.decoder.flush()) + choice.stop.flush()
            text += tail
            choice.result.text += tail
            if choice.stop.is_stopped:  # the last character completed a stop string
                reason = "stop"
        if reason in ("cancelled", "error"):
            for other in list(self._requests.get(choice.seq.request_id, ())):
                if other is not choice:
                    self._retire(other, "cancelled")
        self._retire(choice, reason, error, status)
        return choice.result.last_delta(token_ids, text, logprobs, index=choice.seq.index, request_id=choice.seq.request_id,
                                        others_running=len(self._requests.get(choice.seq.request_id, ())))

    def _retire(self, choice: Choice, reason: str, error: str | None = None, status: int | None = None) -> None:
        """Record a choice's end and free its slot."""
        result = choice.result
        result.finish_reason, result.error, result.error_status = reason, error, status
        result.stop_word = choice.stop.matched
        now = self.clock()
        first = now if choice.first_token_s is None else choice.first_token_s
        result.prompt_time_s, result.decode_time_s = first - choice.arrived_s, now - first
        result.queue_time_s = (choice.first_step_s or now) - choice.arrived_s
        if choice.first_token_s is not None:
            self.counters.ttfts.append((now, result.prompt_time_s))
        if self.prefix is not None and self.speculator is not None and reason in ("stop", "length") and choice.seq.seq_slot is not None:
            self.prefix.store([Span(choice.seq, choice.seq.num_computed, 0)], self.kv)  # the drafts its last pass accepted
        self.scheduler.finish(choice.seq)
        if self.prefix is not None:
            self.prefix.forget(choice.key)
        if self.speculator is not None:
            self.speculator.forget(choice.key)
        del self._choices[choice.key]
        choices = self._requests[choice.seq.request_id]
        choices.remove(choice)
        if not choices:
            del self._requests[choice.seq.request_id]

    # convenience

    def run_all(self, requests: Iterable[EngineRequest | CheckedRequest]) -> dict[str, GenerationResult]:
        """Run requests together to completion (they batch with each other)."""
        results: dict[str, GenerationResult] = {}
        for request in requests:
            self.add_request(request)
            request_id = request.request.request_id if isinstance(request, CheckedRequest) else request.request_id
            results[request_id] = self._choices[(request_id, 0)].result
        while self.has_work():
            self.step()
        return results
