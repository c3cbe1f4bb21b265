"""n > 1 choices on a tiny model: one prefill of the prompt, each choice the request it would be alone."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from tests.helpers import TEST_DEVICE, results_of
from tests.tinymodels import random_lora, write_adapter
from worker.contract.calls import Delta
from worker.contract.params import MAX_CHOICES, SamplingParams
from worker.contract.spec import EngineConfig
from worker.engine.engine import Engine, EngineRequest, RequestError
from worker.engine.outputs import GenerationResult
from worker.engine.runner import ModelRunner

ATTN = ["blk.0.attn_q.weight", "blk.0.attn_k.weight", "blk.1.attn_v.weight"]
PROMPT = [5, 77, 140, 3, 200, 9, 31, 8, 1, 99, 42, 17, 60, 61, 62]
SAMPLED = SamplingParams(max_tokens=10, temperature=1.0, top_k=0, top_p=1.0, seed=1234, ignore_eos=True, logprobs=2)


@pytest.fixture(scope="module")
def runner(tiny_llama, tmp_path_factory) -> ModelRunner:
    d = tmp_path_factory.mktemp("choices")
    return ModelRunner.from_paths(tiny_llama.path, [write_adapter(d / "a.gguf", random_lora(tiny_llama, ATTN, 4, seed=31))], TEST_DEVICE)


def engine_of(runner, slots: int = 6, step_tokens: int = 64) -> Engine:
    return Engine(runner, None, EngineConfig(num_seq_slots=slots, slot_len=64, max_step_tokens=step_tokens))


def run_outputs(engine: Engine, requests: list[EngineRequest]) -> list[Delta]:
    for request in requests:
        engine.add_request(request)
    outputs = []
    while engine.has_work():
        outputs += engine.step()
    return outputs


@dataclass
class ChoiceOutput:
    index: int
    finish_reason: str | None
    result: GenerationResult  # the choice's whole result, put together from its deltas


def choices_of(outputs: list[Delta], request_id: str) -> dict[int, ChoiceOutput]:
    """Each finished choice, with what its deltas carried."""
    return {i: ChoiceOutput(i, r.finish_reason, r) for i, r in results_of(outputs, request_id).items()}


def alone(runner, request: EngineRequest):
    return engine_of(runner, slots=1).run_all([request])[request.request_id]


def assert_same(result, single) -> None:
    assert result.token_ids == single.token_ids
    torch.testing.assert_close(torch.tensor([e.logprob for e in result.logprobs]), torch.tensor([e.logprob for e in single.logprobs]),
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("adapters", [{}, {0: 0.8}])
def test_each_choice_is_the_request_alone_with_its_seed_and_the_prompt_is_computed_once(runner, adapters) -> None:
    engine = engine_of(runner)
    params = SamplingParams(**{**SAMPLED.__dict__, "n": 4})
    outputs = run_outputs(engine, [EngineRequest("r", PROMPT, params, adapters)])
    choices = choices_of(outputs, "r")
    assert sorted(choices) == [0, 1, 2, 3]
    for i, out in choices.items():
        single = alone(runner, EngineRequest("x", PROMPT, SamplingParams(**{**SAMPLED.__dict__, "seed": 1234 + i}), adapters))
        assert_same(out.result, single)
        assert out.result.finish_reason == "length" and len(out.result.token_ids) == 10
    assert len({tuple(c.result.token_ids) for c in choices.values()}) == 4  # distinct samples
    assert engine.counters.prompt_tokens == len(PROMPT)  # once, not four times
    assert engine.counters.forked_prompt_tokens == 3 * len(PROMPT)
    assert engine.counters.generated_tokens == 40
    finals = [o for o in outputs if o.is_finished]
    assert len(finals) == 1 and finals[0] is outputs[-1]  # the request is over once, after its last choice
    assert [o.others_running for o in outputs if o.finish_reason] == [3, 2, 1, 0]
    assert engine.scheduler.num_free_slots == 6

    again = choices_of(run_outputs(engine_of(runner), [EngineRequest("r", PROMPT, params, adapters)]), "r")
    assert {i: c.result.token_ids for i, c in again.items()} == {i: c.result.token_ids for i, c in choices.items()}  # reproducible


def test_choices_in_a_mixed_batch_with_chunked_prefill_and_waiting_for_slots(runner) -> None:
    """Small step budgets split the prompt; five slots hold one n=3 request and two others,
    so the second n=3 request waits for three slots to free."""
    greedy = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=1)
    sampled = SamplingParams(**{**SAMPLED.__dict__, "max_tokens": 6, "n": 3})
    requests = [
        EngineRequest("a", PROMPT, sampled, {0: 1.0}),
        EngineRequest("b", [30, 31, 32, 33], greedy),
        EngineRequest("c", PROMPT[:9], greedy, {0: 0.5}),
        EngineRequest("d", PROMPT[3:], SamplingParams(**{**sampled.__dict__, "seed": 99}), {}),
    ]
    engine = engine_of(runner, slots=5, step_tokens=6)
    outputs = run_outputs(engine, requests)
    for request in requests:
        choices = choices_of(outputs, request.request_id)
        assert sorted(choices) == list(range(request.params.n))
        for i, out in choices.items():
            single = alone(runner, EngineRequest("x", request.prompt_ids, SamplingParams(**{**request.params.__dict__, "n": 1,
                                                                                         "seed": request.params.choice_seed(i)}),
                                                 request.scales_by_slot))
            assert_same(out.result, single)
    assert engine.counters.prompt_tokens == sum(len(r.prompt_ids) for r in requests)
    assert engine.scheduler.num_free_slots == 5


def test_greedy_choices_are_equal_and_max_tokens_zero_ends_every_choice(runner) -> None:
    greedy = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True, n=3)
    choices = choices_of(run_outputs(engine_of(runner), [EngineRequest("g", PROMPT, greedy)]), "g")
    assert len({tuple(c.result.token_ids) for c in choices.values()}) == 1
    assert choices[0].result.token_ids == alone(
        runner, EngineRequest("x", PROMPT, SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))
    ).token_ids

    engine = engine_of(runner)
    nothing = choices_of(run_outputs(engine, [EngineRequest("z", PROMPT, SamplingParams(max_tokens=0, n=2))]), "z")
    assert sorted(nothing) == [0, 1] and all(c.finish_reason == "length" and not c.result.token_ids for c in nothing.values())
    assert engine.scheduler.num_free_slots == 6


def test_a_stop_ends_only_its_choice_and_a_cancel_ends_them_all(runner) -> None:
    engine = engine_of(runner)
    first = alone(runner, EngineRequest("x", PROMPT, SamplingParams(**{**SAMPLED.__dict__, "max_tokens": 3})))
    stop_on = first.token_ids[0]  # choice 0 (seed 1234) stops at once; the others most likely do not
    params = SamplingParams(**{**SAMPLED.__dict__, "n": 3, "stop_token_ids": (stop_on,)})
    choices = choices_of(run_outputs(engine, [EngineRequest("s", PROMPT, params)]), "s")
    assert choices[0].finish_reason == "stop" and choices[0].result.token_ids == []
    assert choices[0].result.stop_logprob == pytest.approx(first.logprobs[0].logprob, abs=1e-5)  # of the stop token, not returned
    for i in (1, 2):  # the others go on as they would alone
        single = alone(runner, EngineRequest("x", PROMPT, SamplingParams(**{**params.__dict__, "n": 1, "seed": params.choice_seed(i)})))
        assert choices[i].result.token_ids == single.token_ids and choices[i].finish_reason == single.finish_reason
    assert any(len(choices[i].result.token_ids) > 0 for i in (1, 2))

    engine.add_request(EngineRequest("c", PROMPT, SamplingParams(**{**SAMPLED.__dict__, "n": 4})))
    engine.step()
    engine.step()
    out = engine.cancel("c")
    assert out.is_finished and out.finish_reason == "cancelled"
    assert engine.scheduler.num_free_slots == 6 and not engine.has_work() and engine.cancel("c") is None


def test_n_beyond_the_sequence_slots_is_refused(runner) -> None:
    with pytest.raises(RequestError, match=r"n \(7\) is more than this worker's 6 sequence slots"):
        engine_of(runner).check(EngineRequest("r", PROMPT, SamplingParams(n=7)))
    with pytest.raises(ValueError, match=f"n must be between 1 and {MAX_CHOICES}"):  # the API's bound, declared once
        SamplingParams(n=0)


def test_choices_of_a_request_with_prompt_logprobs(runner) -> None:
    """The first choice computes the prompt's log-probabilities; the forks still sample its last row."""
    params = SamplingParams(**{**SAMPLED.__dict__, "echo": True, "max_tokens": 4, "n": 3})
    choices = choices_of(run_outputs(engine_of(runner, step_tokens=8), [EngineRequest("e", PROMPT, params, {0: 1.0})]), "e")
    for i, out in choices.items():
        single = alone(
            runner, EngineRequest("x", PROMPT, SamplingParams(**{**params.__dict__, "n": 1, "seed": params.choice_seed(i)}), {0: 1.0})
        )
        assert_same(out.result, single)
    assert len(choices[0].result.prompt_logprobs) == len(PROMPT)
