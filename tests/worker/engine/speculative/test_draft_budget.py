"""Draft rows count in a step's `max_step_tokens`: the drafts take only the rows the step's
scheduled tokens leave, first drafts first, and greedy output stays decoding's."""

from __future__ import annotations

from worker.contract.params import SamplingParams
from worker.contract.spec import EngineConfig
from worker.engine.engine import Engine
from worker.engine.speculative.speculator import Speculator, fit_drafts

from .test_speculation import NGRAM, Oracle, requests


def test_fit_drafts_shares_the_rows_left_depth_by_depth() -> None:
    assert fit_drafts([4, 1, 3], 5) == [2, 1, 2]  # every first draft, then second ones in order
    assert fit_drafts([4, 1, 3], 20) == [4, 1, 3]  # room for all: as planned
    assert fit_drafts([2, 0, 2], 3) == [2, 0, 1]
    assert fit_drafts([3, 3], 0) == [0, 0] and fit_drafts([3], -2) == [0]  # decoding alone used the budget
    assert fit_drafts([], 4) == []


def test_a_steps_rows_with_its_drafts_stay_within_max_step_tokens(runner, tokenizer, monkeypatch) -> None:
    reqs = requests(SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))
    config = EngineConfig(num_seq_slots=5, slot_len=96, max_step_tokens=8)
    expected = Engine(runner, tokenizer, config).run_all(reqs)
    spec = Engine(runner, tokenizer, EngineConfig(num_seq_slots=5, slot_len=96, max_step_tokens=8, speculative=NGRAM))
    oracle = Oracle({(r.request_id, 0): r.prompt_ids + expected[r.request_id].token_ids for r in reqs}, runner.hparams.vocab_size)
    spec.speculator = Speculator(NGRAM, oracle.drafter)
    rows: list[tuple[int, int]] = []  # each pass: its rows (tokens and drafts), and its drafts
    run = runner.run

    def counted(spans, kv):
        rows.append((sum(len(span.token_ids) for span in spans), sum(len(span.draft_samples) for span in spans)))
        return run(spans, kv)

    monkeypatch.setattr(runner, "run", counted)
    got = spec.run_all(reqs)
    assert {r: got[r].token_ids for r in got} == {r: expected[r].token_ids for r in expected}
    assert max(n for n, _ in rows) == 8  # the drafts fill what is left, never more
    assert all(n <= 8 for n, _ in rows), rows
    assert any(drafts and n == 8 for n, drafts in rows)  # 5 decoding rows could have verified 20 drafts: 3 did
    assert spec.counters.drafted_tokens == sum(drafts for _, drafts in rows) > 0
    assert 0 < spec.counters.accepted_draft_tokens < spec.counters.drafted_tokens
