"""The thread count of decode-only passes, chosen by measuring: pure logic on modelled pass
times, then the engine on a tiny model whose passes take a time that depends on the torch
thread count they really ran on."""

from __future__ import annotations

import pytest
import torch

from worker.contract.params import SamplingParams
from worker.contract.spec import DeviceSettings, EngineConfig
from worker.engine.decode_threads import EXPLORE_EVERY, MIN_TRIALS, DecodeThreads, ladder
from worker.engine.engine import Engine, EngineRequest
from worker.engine.runner import ModelRunner
from worker.model.device import DeviceConfig


def decode(threads: DecodeThreads, seconds_on: dict[int, float], num_passes: int, num_decode: int = 8) -> list[int]:
    """Run `num_passes` decode-only passes whose time depends on their thread count; their counts."""
    counts = []
    for _ in range(num_passes):
        n = threads.choose(0)
        threads.observe(n, num_decode, 0, seconds_on[n])
        counts.append(n)
    return counts


def test_the_ladder_halves_down_to_one_thread() -> None:
    assert ladder(16) == [16, 8, 4, 2, 1] and ladder(6) == [6, 3, 1] and ladder(2) == [2, 1] and ladder(1) == [1]


def test_decoding_moves_to_fewer_threads_when_they_are_faster_and_prompts_keep_all() -> None:
    threads = DecodeThreads(2)
    counts = decode(threads, {1: 0.030, 2: 0.045}, EXPLORE_EVERY * (MIN_TRIALS + 1))
    assert threads.current == 1 and threads.num_switches == 1
    assert counts[:EXPLORE_EVERY] == [2] * EXPLORE_EVERY  # it starts on all threads and tries one every EXPLORE_EVERY passes
    assert counts[EXPLORE_EVERY] == 1
    assert threads.choose(100) == 2  # a pass with prompt tokens runs on all of them


def test_decoding_stays_on_all_threads_when_they_are_faster_and_keeps_trying() -> None:
    threads = DecodeThreads(2)
    counts = decode(threads, {1: 0.022, 2: 0.020}, EXPLORE_EVERY * 10)
    assert threads.current == 2 and threads.num_switches == 0
    assert counts.count(1) >= 8  # tries go on: the count can change when the load does
    assert threads.ratio[1] == pytest.approx(1.1)


def test_the_count_comes_back_when_the_load_goes_away() -> None:
    threads = DecodeThreads(4)
    decode(threads, {4: 0.050, 2: 0.030, 1: 0.040}, EXPLORE_EVERY * 12)
    assert threads.current == 2  # one step down; from there one thread is slower
    decode(threads, {4: 0.020, 2: 0.030, 1: 0.040}, EXPLORE_EVERY * 12)
    assert threads.current == 4 and threads.num_switches == 2


def test_tries_that_cannot_be_compared_teach_nothing() -> None:
    threads = DecodeThreads(2)
    for _ in range(EXPLORE_EVERY * 8):
        n = threads.choose(0)
        threads.observe(n, 8 if n == 2 else 7, 0, 0.045 if n == 2 else 0.010)  # a sequence left between the two passes
    assert threads.current == 2 and not threads.trials
    for _ in range(EXPLORE_EVERY * 8):
        n = threads.choose(0)
        threads.observe(n, 8, 0, 0.045 if n == 2 else 0.010)
        threads.observe(2, 4, 60, 0.2)  # a prefill pass between every two: no base for a try
    assert threads.current == 2 and not threads.trials


def test_a_fixed_count_is_never_measured_and_one_thread_has_nothing_to_try() -> None:
    fixed = DecodeThreads(4, fixed=1)
    assert decode(fixed, {1: 0.9, 2: 0.1, 4: 0.1}, EXPLORE_EVERY * 8) == [1] * EXPLORE_EVERY * 8
    assert fixed.choose(10) == 4
    assert DecodeThreads(2, fixed=8).current == 2  # at most the threads there are
    single = DecodeThreads(1)
    assert decode(single, {1: 0.03}, EXPLORE_EVERY * 4) == [1] * EXPLORE_EVERY * 4
    with pytest.raises(ValueError, match="max_threads"):
        DecodeThreads(0)
    with pytest.raises(ValueError, match="decode_threads must be between 1 and threads"):
        DeviceSettings(threads=2, decode_threads=3)
    with pytest.raises(ValueError, match="a count or 'auto'"):
        DeviceSettings(decode_threads="fast")


class ThreadTimedRunner:
    """The real runner on a clock each pass advances by a time set by the torch thread count it
    ran on (read from torch, so the engine must really have set it); it keeps each pass's
    (threads, tokens)."""

    def __init__(self, runner: ModelRunner, seconds_on: dict[int, float]) -> None:
        self.runner, self.seconds_on, self.now, self.passes = runner, seconds_on, 0.0, []

    def __getattr__(self, name):
        return getattr(self.runner, name)

    def clock(self) -> float:
        return self.now

    def run(self, spans, kv):
        n = torch.get_num_threads()
        self.passes.append((n, sum(len(s.token_ids) for s in spans)))
        self.now += self.seconds_on[n]
        return self.runner.run(spans, kv)


@pytest.fixture
def two_thread_runner(tiny_llama):
    before = torch.get_num_threads()
    try:
        yield ModelRunner.from_paths(tiny_llama.path, [], DeviceConfig.of(DeviceSettings(threads=2, decode_threads="auto")))
    finally:
        torch.set_num_threads(before)


def test_the_engine_decodes_on_the_thread_count_it_measured_fastest(two_thread_runner) -> None:
    assert two_thread_runner.max_threads == 2
    timed = ThreadTimedRunner(two_thread_runner, {1: 0.030, 2: 0.045})
    engine = Engine(timed, None, EngineConfig(num_seq_slots=2, slot_len=256), clock=timed.clock)
    engine.add_request(
        EngineRequest("a", list(range(10, 14)), SamplingParams(max_tokens=EXPLORE_EVERY * (MIN_TRIALS + 4), temperature=0, ignore_eos=True))
    )
    while engine.has_work():
        engine.step()
    assert engine.threads.current == 1 and timed.passes[0] == (2, 4)  # the prompt on both threads
    last = [n for n, _ in timed.passes[-2 * EXPLORE_EVERY:]]
    assert last.count(2) <= 2 and last.count(1) >= 2 * EXPLORE_EVERY - 2  # decoding on one, trying two now and then
    timed.seconds_on = {1: 0.030, 2: 0.015}  # the cores are free again
    engine.add_request(
        EngineRequest("b", [5, 6, 7], SamplingParams(max_tokens=EXPLORE_EVERY * (MIN_TRIALS + 2), temperature=0, ignore_eos=True))
    )
    while engine.has_work():
        engine.step()
    assert engine.threads.current == 2 and engine.threads.num_switches == 2


def test_a_configured_decode_count_is_used_as_is(tiny_llama) -> None:
    before = torch.get_num_threads()
    try:  # on the CPU, whatever device the suite runs on: threads are a CPU device's matter
        runner = ModelRunner.from_paths(tiny_llama.path, [], DeviceConfig.of(DeviceSettings(threads=2, decode_threads=1)))
        timed = ThreadTimedRunner(runner, {1: 0.090, 2: 0.010})
        engine = Engine(timed, None, EngineConfig(num_seq_slots=1, slot_len=128), clock=timed.clock)
        engine.run_all(
            [EngineRequest("a", list(range(10, 30)), SamplingParams(max_tokens=EXPLORE_EVERY * 4, temperature=0, ignore_eos=True))]
        )
    finally:
        torch.set_num_threads(before)
    assert [n for n, _ in timed.passes] == [2] + [1] * (len(timed.passes) - 1)


def test_by_default_decoding_keeps_all_threads(two_thread_runner, tiny_llama) -> None:
    """Measuring is asked for ("auto"): a token's logits may differ in the last bits between
    thread counts, and by default a request gives the same ones every time."""
    runner = ModelRunner.from_paths(tiny_llama.path, [], DeviceConfig.of(DeviceSettings(threads=2)))
    timed = ThreadTimedRunner(runner, {1: 0.010, 2: 0.090})
    engine = Engine(timed, None, EngineConfig(num_seq_slots=1, slot_len=128), clock=timed.clock)
    engine.run_all([EngineRequest("a", [5, 6, 7], SamplingParams(max_tokens=EXPLORE_EVERY * 4, temperature=0, ignore_eos=True))])
    assert {n for n, _ in timed.passes} == {2} and engine.threads.current == 2
