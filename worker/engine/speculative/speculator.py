"""One engine's speculation: which decoding sequences draft in a step and how many tokens (a
grammar's forced tokens where it forces some, else the drafter's lookup), the drafts' sampling
specs, and what each sequence's verifications taught (its acceptance, the step costs)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Protocol

from worker.contract.identity import Fingerprint
from worker.contract.spec import SpeculativeConfig
from worker.engine.request import Choice
from worker.engine.outputs import StepTokens
from worker.engine.scheduler import Scheduler, Span
from worker.engine.runner import ModelRunner
from worker.engine.speculative.draft_model import DraftModel
from worker.engine.speculative.ngram import NgramIndex
from worker.engine.speculative.policy import Acceptance, DraftCosts
from worker.engine.speculative.text_lookup import TextIndex, text_tokenizer
from worker.engine.speculative.verify import DraftedSpan, grammar_masks, replay_draws
from worker.formats.tokenizer import GGUFTokenizer
from worker.lora.mapping import RequestAdapters
from worker.model.sampler import SampleSpec

Key = tuple[str, int]  # a sequence's key: request id and choice
# a grammar's forced token is the target's pick unless the grammar allows another spelling of the same text
FORCED_RATE = 0.95


class Drafter(Protocol):
    """One sequence's drafter: up to `max_draft` tokens likely to follow `tokens` (its prompt and
    the tokens accepted so far, which only ever grow)."""

    def draft(self, tokens: Sequence[int], max_draft: int) -> list[int]: ...


# a sequence's drafter, from its key and its adapters (the target's mapping: a draft model may follow them)
NewDrafter = Callable[[Key, RequestAdapters], Drafter]


def open_speculator(config: SpeculativeConfig, runner: ModelRunner, num_seq_slots: int, slot_len: int,
                    tokenizer: GGUFTokenizer | None = None) -> Speculator | None:
    """An engine's speculator as `config` says (None: off): a draft model's drafters (`method:
    draft`, loaded beside `runner` with a KV slot per engine slot and its draft LoRAs, each sequence's
    chosen by its adapters), or lookups in each sequence's text with the model's `tokenizer` (built
    from `runner`'s GGUF when not given), in its tokens where that tokenizer is not byte-level BPE
    (`method: ngram`)."""
    if not config.is_on:
        return None
    if config.method == "draft":
        draft_adapters = {Fingerprint(target): path for target, path in config.draft_adapters.items()}
        return Speculator(config, DraftModel.load(config.draft_model, runner, num_seq_slots, slot_len, draft_adapters).new_drafter)
    tokenizer = text_tokenizer(runner.base, tokenizer)
    return Speculator(config, None if tokenizer is None else lambda key, adapters: TextIndex(tokenizer))


class Speculator:
    def __init__(self, config: SpeculativeConfig, new_drafter: NewDrafter | None = None) -> None:
        self.config = config
        self.costs = DraftCosts()  # of the steps that only decode, with drafts and without
        self._new_drafter = new_drafter or (lambda key, adapters: NgramIndex(config.ngram_min, config.ngram_max))
        self._drafters: dict[Key, Drafter] = {}
        self._acceptance: dict[Key, Acceptance] = {}

    def draft(self, spans: list[Span], choices: Mapping[Key, Choice], drafted: dict[Key, DraftedSpan],
              max_step_tokens: int) -> list[Span]:
        """The step's spans, decoding ones with the drafts they verify; `drafted` gets each one's.

        Draft rows count in the step's `max_step_tokens`: they take only what the scheduled
        tokens leave of it (`fit_drafts`). The scheduler fills the budget with sure work (each
        decoding token, then prompt chunks) before any drafter is asked; a draft is a guess,
        so it rides on the rows left rather than the scheduler reserving rows for drafts it
        cannot know of, which would hold back prompts even in steps that draft nothing."""
        drafted.clear()
        room = max_step_tokens - sum(span.length for span in spans)  # rows the step's tokens leave
        eligible: list[tuple[int, Choice, int]] = []  # (span, choice, drafts it may verify)
        for i, span in enumerate(spans):
            seq = span.seq
            if span.length != 1 or span.fork_of is not None or seq.is_prefilling or not span.samples:
                continue
            choice = choices[seq.key]
            params = choice.request.params
            wanted = self.config.max_draft if params.max_draft_tokens is None else min(params.max_draft_tokens, self.config.max_draft)
            limit = min(wanted, seq.max_len - len(seq.token_ids) - 1)  # the tokens kept stay within max_tokens
            if limit > 0 and self._acceptance.setdefault(seq.key, Acceptance()).may_draft():
                eligible.append((i, choice, limit))
        num_rows = sum(span.length - span.prompt_tokens for span in spans)  # the step's decoding rows: its tokens
        if room <= 0 or not eligible or (self.config.is_adaptive and not self.costs.may_draft(
                num_rows, max(self._best_rate(choice) for _, choice, _ in eligible))):
            return spans  # no room, or no draft can pay: none is looked up
        candidates: list[tuple[int, Choice, list[int], float]] = []
        for i, choice, limit in eligible:
            tokens, rate = self._lookup(choice, limit)
            if tokens and len(tokens) >= choice.request.params.min_draft_tokens:
                candidates.append((i, choice, tokens, rate))
        if not candidates:
            return spans
        lengths = [len(tokens) for _, _, tokens, _ in candidates]
        if self.config.is_adaptive:
            lengths = self.costs.plan(num_rows, lengths, [rate for _, _, _, rate in candidates])
        lengths = fit_drafts(lengths, room)
        spans = list(spans)
        for (i, choice, tokens, _), n in zip(candidates, lengths):
            params, masks = choice.request.params, None
            tokens = tokens[:n]
            if choice.matcher is not None and tokens:
                tokens, masks = grammar_masks(choice.matcher, tokens)
            if not tokens or len(tokens) < params.min_draft_tokens:
                continue
            is_greedy = SampleSpec(params, choice.generator).is_greedy
            drafted[choice.key] = DraftedSpan(tuple(tokens), tuple(masks) if masks else None,
                                              None if is_greedy else choice.generator.get_state())
            spans[i] = replace(spans[i], drafts=tuple(tokens))
        return spans

    def _best_rate(self, choice: Choice) -> float:
        """The likeliest acceptance a choice's drafts may have this step (a grammar may force them)."""
        rate = self._acceptance[choice.key].rate
        return max(rate, FORCED_RATE) if choice.matcher is not None else rate

    def _lookup(self, choice: Choice, limit: int) -> tuple[list[int], float]:
        """Up to `limit` drafts of a choice, and the rate they are accepted at: under a grammar,
        the tokens it forces next when it forces some (llguidance's fast-forward tokens: the
        only text the grammar allows, a JSON schema's keys and punctuation), else its drafter's
        lookup at the sequence's recent acceptance."""
        if choice.matcher is not None:
            forced = choice.matcher.compute_ff_tokens()[:limit]
            if forced:
                return forced, FORCED_RATE
        drafter = self._drafters.get(choice.key)
        if drafter is None:
            drafter = self._drafters[choice.key] = self._new_drafter(choice.key, choice.adapters)
        return drafter.draft(choice.seq.token_ids, limit), self._acceptance[choice.key].rate

    def verified(self, choice: Choice, drafted: DraftedSpan, taken: StepTokens, scheduler: Scheduler) -> None:
        """After a choice's speculative span (it goes on): its generator stands after the draws of
        the tokens kept, its tenant is credited with them, its acceptance is noted."""
        num_taken = len(taken.token_ids)
        if drafted.generator_state is not None:
            replay_draws(choice.generator, drafted.generator_state, num_taken)
        scheduler.credit(choice.seq.tenant, num_taken - 1)
        acceptance = self._acceptance.get(choice.key)
        if acceptance is not None:
            acceptance.observe(len(drafted.drafts), taken.num_accepted, self.config.min_acceptance)

    def forget(self, key: Key) -> None:
        self._drafters.pop(key, None)
        self._acceptance.pop(key, None)


def draft_samples(first: SampleSpec, token_ids: list[int], num_prompt_tokens: int, drafted: DraftedSpan) -> list[SampleSpec]:
    """How each verifying row picks its token: row j as decoding would after the first j drafts
    (`first` is row 0's): its penalty window and grammar mask follow the drafts."""
    specs = []
    for j in range(len(drafted.drafts) + 1):
        window = first.params.penalty_window(token_ids + list(drafted.drafts[:j]), num_prompt_tokens) if j else first.penalized
        mask = drafted.masks[j] if drafted.masks is not None else first.allowed
        specs.append(replace(first, penalized=window, allowed=mask))
    return specs


def fit_drafts(lengths: Sequence[int], room: int) -> list[int]:
    """Each candidate's drafts (`lengths` planned) within `room` rows, depth by depth: every
    sequence's first draft, then every second one, and so on. A draft counts only when those
    before it are accepted, so a shallower draft is the likelier token."""
    fitted = [0] * len(lengths)
    for depth in range(max(lengths, default=0)):
        for i, n in enumerate(lengths):
            if room <= 0:
                return fitted
            if n > depth:
                fitted[i] += 1
                room -= 1
    return fitted
