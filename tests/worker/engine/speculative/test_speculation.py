"""Speculative decoding in the engine on a tiny model: whatever is drafted, the output is what
decoding gives, token for token, in mixed batches (stacked adapters, aLoRA, penalties, stop
strings, n > 1, grammars), seeded sampling included; rejected drafts leave nothing behind.

A random tiny model copies nothing, so the drafts come from an oracle: the tokens decoding
gave, with every third position wrong, so verification accepts, rejects and does both in one
span."""

from __future__ import annotations

import pytest

from cache.prefix import PrefixCache, PrefixCacheConfig
from worker.contract.params import SamplingParams
from worker.contract.spec import EngineConfig, SpeculativeConfig
from worker.engine import prefix_kv
from worker.engine.engine import Engine, EngineRequest
from worker.engine.speculative.speculator import Speculator
from worker.formats.grammar import json_schema_grammar

NGRAM = SpeculativeConfig(method="ngram", max_draft=4, is_adaptive=False)


class Oracle:
    """Drafts what decoding gave after the sequence's tokens so far, every third position wrong."""

    def __init__(self, expected: dict[tuple[str, int], list[int]], vocab_size: int) -> None:
        self.expected, self.vocab_size = expected, vocab_size
        self.num_drafts = 0

    def drafter(self, key, adapters=None):
        full = self.expected.get(key, [])

        class Draft:
            def draft(inner, tokens, max_draft):  # noqa: N805 - the drafter of one sequence
                if list(tokens) != full[: len(tokens)]:
                    return []
                drafts = full[len(tokens) : len(tokens) + max_draft]
                self.num_drafts += len(drafts)
                return [(t + 1) % self.vocab_size if (len(tokens) + j) % 3 == 2 else t for j, t in enumerate(drafts)]

        return Draft()


def requests(params: SamplingParams) -> list[EngineRequest]:
    prompts = [[5, 77, 140, 3, 200, 9, 31], [8, 1, 99, 42, 17, 250, 12, 60, 61], [30, 31, 32], [40, 41, 42, 43, 250, 12, 44], [100, 101]]
    scales = [{0: 1.0}, {3: 1.0}, {0: 1.0, 1: -0.7}, {3: 1.0, 1: 0.5}, {}]  # 3: the aLoRA (tests/worker/engine/conftest.py)
    return [EngineRequest(f"r{i}", p, params, s) for i, (p, s) in enumerate(zip(prompts, scales))]


def run_both(runner, tokenizer, reqs, config=NGRAM, slots=8, **engine_options):
    """Each request's results without speculation and with the oracle's drafts, all in one batch each."""
    plain = Engine(runner, tokenizer, EngineConfig(num_seq_slots=slots, slot_len=96, max_step_tokens=24), **engine_options)
    expected_results = plain.run_all(reqs)
    expected = {}
    for r in reqs:
        for i in range(r.params.n):
            result = plain.result(r.request_id, i) if r.params.n > 1 else expected_results[r.request_id]
            expected[(r.request_id, i)] = result.prompt_ids + result.token_ids
    spec = Engine(runner, tokenizer, EngineConfig(num_seq_slots=slots, slot_len=96, max_step_tokens=24, speculative=config),
                  **engine_options)
    oracle = Oracle(expected, runner.hparams.vocab_size)
    spec.speculator = Speculator(config, oracle.drafter)
    got = spec.run_all(reqs)
    assert spec.counters.steps < plain.counters.steps  # verified drafts saved passes
    return expected_results, got, spec


def assert_identical(expected, got, spec) -> None:
    for request_id, want in expected.items():
        have = got[request_id]
        assert have.token_ids == want.token_ids, request_id
        assert have.text == want.text and have.finish_reason == want.finish_reason
        if want.logprobs is not None:
            assert [e.token_id for e in have.logprobs] == [e.token_id for e in want.logprobs]
            for a, b in zip(have.logprobs, want.logprobs):
                assert a.logprob == pytest.approx(b.logprob, abs=1e-5)
                assert [t for t, _ in a.top] == [t for t, _ in b.top]
    drafted, accepted = spec.counters.drafted_tokens, spec.counters.accepted_draft_tokens
    assert 0 < accepted < drafted  # drafts were verified, some accepted, some not
    assert sum(r.num_draft_accepted for r in got.values()) <= accepted
    assert spec.counters.generated_tokens == sum(len(r.token_ids) for r in got.values()) or any(
        r.finish_reason == "stop" for r in got.values())
    assert spec.scheduler.num_free_slots == spec.config.num_seq_slots


def test_greedy_output_is_decodings_in_a_mixed_adapter_batch(runner, tokenizer) -> None:
    reqs = requests(SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, logprobs=3))
    expected, got, spec = run_both(runner, tokenizer, reqs)
    assert_identical(expected, got, spec)
    assert got["r1"].alora_activation == 4 and got["r3"].alora_activation == 3  # the aLoRA's rows: from before its invocation


def test_seeded_sampling_gives_decodings_tokens_whatever_the_drafts(runner, tokenizer) -> None:
    params = SamplingParams(max_tokens=20, temperature=1.0, top_p=0.9, top_k=0, seed=1234, ignore_eos=True, logprobs=2)
    expected, got, spec = run_both(runner, tokenizer, requests(params))
    assert_identical(expected, got, spec)


def test_penalties_and_logit_bias_see_the_drafts_before_each_position(runner, tokenizer) -> None:
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, presence_penalty=0.8, frequency_penalty=0.5,
                            repeat_penalty=1.3, penalty_last_n=6, logit_bias=((7, 3.0), (11, -100.0)))
    expected, got, spec = run_both(runner, tokenizer, requests(params))
    assert_identical(expected, got, spec)


def test_stop_strings_max_tokens_and_end_of_generation_end_where_decoding_ends(runner, tokenizer) -> None:
    free = SamplingParams(max_tokens=30, temperature=0)
    plain = Engine(runner, tokenizer, EngineConfig(num_seq_slots=8, slot_len=96)).run_all(requests(free))
    text = plain["r0"].text
    stop = text[len(text) // 2 : len(text) // 2 + 3]  # something decoding produces in the middle
    assert stop.strip()
    reqs = [EngineRequest(r.request_id, r.prompt_ids, SamplingParams(max_tokens=30 - 5 * i, temperature=0, stop=(stop,)), r.scales_by_slot)
            for i, r in enumerate(requests(free))]
    expected, got, spec = run_both(runner, tokenizer, reqs)
    assert_identical(expected, got, spec)
    assert got["r0"].finish_reason == "stop" and got["r0"].stop_word == stop
    assert {r.finish_reason for r in got.values()} >= {"stop", "length"}


def test_n_choices_each_decode_as_without_drafts(runner, tokenizer) -> None:
    reqs = [EngineRequest("n", [5, 77, 140, 3], SamplingParams(max_tokens=16, temperature=1.0, seed=7, n=3, ignore_eos=True), {0: 1.0}),
            EngineRequest("g", [9, 8, 7], SamplingParams(max_tokens=16, temperature=0, n=2, ignore_eos=True), {1: 1.0})]
    plain = Engine(runner, tokenizer, EngineConfig(num_seq_slots=8, slot_len=96))
    plain.add_request(reqs[0]), plain.add_request(reqs[1])
    results = {key: plain.result(*key) for key in [("n", 0), ("n", 1), ("n", 2), ("g", 0), ("g", 1)]}
    while plain.has_work():
        plain.step()
    expected = {key: r.prompt_ids + r.token_ids for key, r in results.items()}
    spec = Engine(runner, tokenizer, EngineConfig(num_seq_slots=8, slot_len=96, speculative=NGRAM))
    spec.speculator = Speculator(NGRAM, Oracle(expected, runner.hparams.vocab_size).drafter)
    spec.add_request(reqs[0]), spec.add_request(reqs[1])
    got = {key: spec.result(*key) for key in results}
    while spec.has_work():
        spec.step()
    for key, want in results.items():
        assert got[key].token_ids == want.token_ids, key
    assert len({tuple(results[("n", i)].token_ids) for i in range(3)}) == 3
    assert 0 < spec.counters.accepted_draft_tokens < spec.counters.drafted_tokens


def test_a_grammar_checks_each_draft_against_its_mask(runner, tokenizer) -> None:
    schema = {"type": "object", "properties": {"name": {"enum": ["ada", "bob"]}, "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}
    grammar = json_schema_grammar(schema)
    reqs = [EngineRequest(f"j{i}", [5, 77 + i], SamplingParams(max_tokens=40, temperature=t, seed=i, grammar=grammar), {0: 1.0})
            for i, t in enumerate((0, 1.0, 0.7))] + requests(SamplingParams(max_tokens=12, temperature=0))[:2]
    expected, got, spec = run_both(runner, tokenizer, reqs)
    assert_identical(expected, got, spec)


class DraftsNothing:
    def draft(self, tokens, max_draft):
        return []


def test_a_grammars_forced_tokens_are_drafts_of_their_own(runner, tokenizer) -> None:
    # a JSON schema forces its keys and punctuation: they are drafted though the lookup finds nothing
    schema = {"type": "object", "properties": {"name": {"enum": ["ada", "bob"]}, "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}
    grammar = json_schema_grammar(schema)
    reqs = [EngineRequest(f"j{i}", [5, 77 + i], SamplingParams(max_tokens=40, temperature=t, seed=i, grammar=grammar))
            for i, t in enumerate((0, 0.8))]
    plain = Engine(runner, tokenizer, EngineConfig(num_seq_slots=4, slot_len=96))
    expected = plain.run_all(reqs)
    spec = Engine(runner, tokenizer, EngineConfig(num_seq_slots=4, slot_len=96, speculative=NGRAM))
    spec.speculator = Speculator(NGRAM, lambda key, adapters: DraftsNothing())
    got = spec.run_all(reqs)
    assert {k: r.token_ids for k, r in got.items()} == {k: r.token_ids for k, r in expected.items()}
    assert spec.counters.accepted_draft_tokens > 0 and spec.counters.steps < plain.counters.steps


def test_the_prefix_cache_stores_what_decoding_stores_and_nothing_rejected(runner, tokenizer) -> None:
    """Chunks of 4 tokens: a generated chunk is stored once its tokens are accepted, never with a rejected draft's KV."""
    stored: dict[str, list] = {"plain": [], "spec": []}

    def cache(which):
        c = prefix_kv.open_prefix_cache(runner, PrefixCacheConfig(chunk_tokens=4))
        original = c.store

        def store(items):
            stored[which].extend((key, value.k.copy(), value.v.copy()) for key, value in items)
            return original(items)

        c.store = store
        return c

    params = SamplingParams(max_tokens=22, temperature=0, ignore_eos=True)
    reqs = requests(params)
    plain_cache, spec_cache = cache("plain"), cache("spec")
    expected = Engine(runner, tokenizer, EngineConfig(num_seq_slots=8, slot_len=96), prefix_cache=plain_cache).run_all(reqs)
    spec = Engine(runner, tokenizer, EngineConfig(num_seq_slots=8, slot_len=96, speculative=NGRAM), prefix_cache=spec_cache)
    oracle = Oracle({(r.request_id, 0): r.prompt_ids + expected[r.request_id].token_ids for r in reqs}, runner.hparams.vocab_size)
    spec.speculator = Speculator(NGRAM, oracle.drafter)
    got = spec.run_all(reqs)
    assert [got[r.request_id].token_ids for r in reqs] == [expected[r.request_id].token_ids for r in reqs]
    assert isinstance(plain_cache, PrefixCache) and stored["plain"]
    plain_chunks = {key: (k, v) for key, k, v in stored["plain"]}
    assert sorted(key for key, _, _ in stored["spec"]) == sorted(plain_chunks)  # the same chunks: prompt and accepted tokens
    for key, k, v in stored["spec"]:
        assert abs(k - plain_chunks[key][0]).max() < 1e-5 and abs(v - plain_chunks[key][1]).max() < 1e-5
    assert 0 < spec.counters.accepted_draft_tokens < spec.counters.drafted_tokens
