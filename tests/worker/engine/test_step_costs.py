"""The prompt budget of a step that decodes, from measured pass times: pure logic, then the
engine on a tiny model whose passes take modelled times on a clock of the test's own."""

from __future__ import annotations

import pytest

from tests.helpers import TEST_DEVICE
from worker.contract.params import SamplingParams
from worker.contract.spec import EngineConfig
from worker.engine.engine import Engine, EngineRequest
from worker.engine.runner import ModelRunner
from worker.engine.step_costs import StepCosts

FIXED_S, DECODE_TOKEN_S, PROMPT_TOKEN_S = 0.020, 0.002, 0.0015  # a modelled pass: fixed part + per token


def pass_s(decode_tokens: int, prompt_tokens: int) -> float:
    return FIXED_S + DECODE_TOKEN_S * decode_tokens + PROMPT_TOKEN_S * prompt_tokens


def test_cheap_prompt_tokens_raise_the_budget_within_the_stall_dear_ones_keep_the_floor() -> None:
    costs = StepCosts()
    assert costs.prompt_budget(4, 1.5) == 4  # nothing measured yet: the floor
    for _ in range(10):
        for decode, prompt in [(16, 0), (0, 200), (3, 120), (12, 60), (16, 0)]:
            costs.observe(decode, prompt, pass_s(decode, prompt))
    budget = costs.prompt_budget(4, 1.5)
    decode_only = pass_s(16, 0)
    assert pass_s(16, budget) <= 2.5 * decode_only  # the stall holds
    assert budget >= 0.6 * 1.5 * decode_only / PROMPT_TOKEN_S  # the estimate is high, not wild
    assert costs.prompt_budget(4, 3.0) > budget  # a longer stall buys more prompt tokens
    assert costs.prompt_budget(500, 1.5) == 500  # dearer than the floor: the floor
    assert costs.prompt_budget(4, None) == 4 and costs.prompt_budget(None, 1.5) is None


def test_steps_that_say_nothing_of_a_cost_teach_nothing() -> None:
    costs = StepCosts()
    costs.observe(4, 100, 0.3)  # its decode part is not known yet
    costs.observe(0, 3, 0.01)  # too few prompt tokens to tell
    costs.observe(8, 0, 0.0)  # a clock that does not move (a test's)
    assert costs.prompt_token_s is None and costs.decode_s is None
    costs.observe(8, 0, 0.05)
    costs.observe(0, 100, 0.2)
    assert costs.prompt_budget(1, 1.0) == 25  # 0.05 s of prompt tokens at 2 ms each


class TimedRunner:
    """The real runner, on a clock that each pass advances by its modelled time; it keeps every
    pass's (decode tokens, prompt tokens) and the prompt tokens of each that also decoded."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner, self.now, self.prompt_while_decoding, self.passes = runner, 0.0, [], []

    def __getattr__(self, name):
        return getattr(self.runner, name)

    def clock(self) -> float:
        return self.now

    def run(self, spans, kv):
        decode = sum(1 for s in spans if s.sample is not None and len(s.token_ids) == 1 and s.start > 0)
        prompt = sum(len(s.token_ids) for s in spans) - decode
        if decode:
            self.prompt_while_decoding.append(prompt)
        self.passes.append((decode, prompt))
        self.now += pass_s(decode, prompt)
        return self.runner.run(spans, kv)


@pytest.fixture(scope="module")
def runner(tiny_llama) -> ModelRunner:
    return ModelRunner.from_paths(tiny_llama.path, [], TEST_DEVICE)


@pytest.mark.parametrize(("floor", "decode_stall"), [(4, 1.0), (4, 3.0), (30, 1.0)])
def test_the_engine_sizes_prompt_chunks_of_decoding_steps_by_measured_time(runner, floor, decode_stall) -> None:
    timed = TimedRunner(runner)
    config = EngineConfig(num_seq_slots=4, slot_len=128, max_step_tokens=128, prefill_while_decoding=floor, decode_stall=decode_stall)
    engine = Engine(timed, None, config, clock=timed.clock)
    engine.run_all([EngineRequest("warm", [10 + i for i in range(40)], SamplingParams(max_tokens=1, temperature=0))])  # a prompt alone
    engine.add_request(EngineRequest("decoding", [5, 6, 7], SamplingParams(max_tokens=100, temperature=0, ignore_eos=True)))
    for _ in range(12):  # decode-only steps
        engine.step()
    engine.add_request(EngineRequest("long prompt", [10 + i % 200 for i in range(90)], SamplingParams(max_tokens=1, temperature=0)))
    while engine.has_work():
        engine.step()
    chunks = [p for p in timed.prompt_while_decoding if p]
    within = decode_stall * pass_s(1, 0) / PROMPT_TOKEN_S  # the prompt tokens that fit in the stall at the modelled cost
    assert sum(chunks) == 90 and len(chunks) >= 3
    assert max(chunks) <= max(floor, within)  # every chunk keeps the stall, or the floor
    assert min(chunks[:-1]) >= max(floor, 0.5 * within)  # and is as big as the estimate allows


def test_the_engine_reports_its_step_times_as_prometheus_histograms(runner) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    timed = TimedRunner(runner)
    engine = Engine(timed, None, EngineConfig(num_seq_slots=2, slot_len=64, max_step_tokens=64), clock=timed.clock)
    engine.run_all([EngineRequest("a", [5, 6, 7, 8], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)),
                    EngineRequest("b", list(range(10, 40)), SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))])
    families = {f.name: f for f in text_string_to_metric_families(engine.counters.prometheus())}
    samples = {f"{s.name}{s.labels.get('le', '')}": s.value
               for name in ("loraplex_engine_step_seconds", "loraplex_engine_decode_step_seconds")
               for s in families[name].samples}
    steps = engine.counters.steps
    decode_only = sum(1 for _, prompt in timed.passes if prompt == 0)
    assert (
        samples["loraplex_engine_step_seconds_count"] == steps
        and samples["loraplex_engine_step_seconds_sum"] == pytest.approx(timed.now)
    )
    assert samples["loraplex_engine_decode_step_seconds_count"] == decode_only > 0
    assert samples["loraplex_engine_step_seconds_bucket0.02"] == 0  # every modelled pass costs more than its fixed 20 ms
    assert samples["loraplex_engine_step_seconds_bucket0.2"] == steps  # and less than 200 ms
