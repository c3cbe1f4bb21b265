"""The adaptive policy in the engine, on a clock that the passes advance by a cost model: where
a row costs a token (compute-bound) drafts are only probed, where the step's fixed part
dominates nearly every step drafts; either way the output is decoding's."""

from __future__ import annotations

from collections.abc import Callable

from tests.worker.engine.speculative.test_speculation import Oracle, requests
from worker.contract.params import SamplingParams
from worker.contract.spec import EngineConfig, SpeculativeConfig
from worker.engine.engine import Engine
from worker.engine.speculative.policy import MIN_PLAIN_STEPS, PROBE_EVERY
from worker.engine.speculative.speculator import Speculator

ADAPTIVE = SpeculativeConfig(method="ngram", max_draft=4, is_adaptive=True)


class FakeClock:
    def __init__(self) -> None:
        self.now_s = 0.0

    def __call__(self) -> float:
        return self.now_s


class TimedRunner:
    """The runner, each pass advancing the clock by `cost_s(rows without drafts, draft rows)`."""

    def __init__(self, runner, clock: FakeClock, cost_s: Callable[[int, int], float]) -> None:
        self._runner, self._clock, self._cost_s = runner, clock, cost_s
        self.drafts_per_pass: list[int] = []

    def __getattr__(self, name: str):
        return getattr(self._runner, name)

    def run(self, spans, kv):
        num_drafts = sum(len(span.draft_samples) for span in spans)
        self.drafts_per_pass.append(num_drafts)
        self._clock.now_s += self._cost_s(sum(len(span.token_ids) for span in spans) - num_drafts, num_drafts)
        return self._runner.run(spans, kv)


def run_adaptive(runner, tokenizer, cost_s: Callable[[int, int], float]):
    reqs = requests(SamplingParams(max_tokens=60, temperature=0, ignore_eos=True))
    config = EngineConfig(num_seq_slots=8, slot_len=96, max_step_tokens=64)
    plain = Engine(runner, tokenizer, config)
    expected = plain.run_all(reqs)
    clock = FakeClock()
    timed = TimedRunner(runner, clock, cost_s)
    spec = Engine(timed, tokenizer, EngineConfig(num_seq_slots=8, slot_len=96, max_step_tokens=64, speculative=ADAPTIVE),
                  clock=clock)
    full = {(r.request_id, 0): r.prompt_ids + expected[r.request_id].token_ids for r in reqs}
    spec.speculator = Speculator(ADAPTIVE, Oracle(full, runner.hparams.vocab_size).drafter)
    got = spec.run_all(reqs)
    for r in reqs:
        assert got[r.request_id].token_ids == expected[r.request_id].token_ids, r.request_id
    return plain, spec, timed.drafts_per_pass


def test_compute_bound_passes_only_probe_drafts(runner, tokenizer) -> None:
    plain, spec, drafts_per_pass = run_adaptive(runner, tokenizer, lambda rows, drafts: 0.001 + 0.010 * (rows + drafts))
    num_drafting = sum(1 for n in drafts_per_pass if n)
    assert len(drafts_per_pass) > 2 * PROBE_EVERY
    assert 1 <= num_drafting <= 1 + len(drafts_per_pass) // PROBE_EVERY
    assert max(drafts_per_pass) <= ADAPTIVE.max_draft  # a probe verifies one sequence's drafts
    assert spec.counters.steps >= plain.counters.steps - num_drafting * ADAPTIVE.max_draft


def test_bandwidth_bound_passes_draft_all_but_a_few(runner, tokenizer) -> None:
    plain, spec, drafts_per_pass = run_adaptive(runner, tokenizer, lambda rows, drafts: 0.050 + 0.0001 * (rows + drafts))
    num_plain = sum(1 for n in drafts_per_pass[1:] if n == 0)  # after the prompts' pass
    assert num_plain <= MIN_PLAIN_STEPS + 1 + len(drafts_per_pass) // PROBE_EVERY  # the first plain steps, the probes
    assert spec.counters.steps < plain.counters.steps
    assert spec.counters.accepted_draft_tokens > 0
