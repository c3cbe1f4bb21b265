"""The engine on a tiny model: a request's result does not depend on its batch."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import TEST_DEVICE, prompt_logits
from tests.tinymodels import random_lora, write_adapter
from worker.contract.params import SamplingParams
from worker.contract.spec import EngineConfig
from worker.engine.engine import Engine, EngineRequest, RequestError
from worker.engine.loop import EngineLoop
from worker.engine.runner import ModelRunner
from worker.formats.gguf_file import GGUFFile
from worker.formats.tokenizer import GGUFTokenizer
from worker.lora.mapping import token_scales
from worker.model.attention import Segment

GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=3)


def mixed_requests(params: SamplingParams = GREEDY) -> list[EngineRequest]:
    prompts = [
        [5, 77, 140, 3, 200, 9, 31],
        [8, 1, 99, 42, 17, 250, 12, 60, 61, 62, 63, 64, 65, 66, 67, 68, 69, 70],
        [30, 31, 32],
        [100, 101, 102, 103, 104, 105, 106, 107, 108, 109, 110, 111],
        [40, 41, 42, 43, 250, 12, 44],
        [40, 41, 42, 43, 44, 45, 46],
    ]
    adapters = [{0: 1.0}, {1: 0.5}, {0: 1.0, 1: -0.7, 2: 1.3}, {}, {3: 1.0, 2: 0.5}, {3: 1.0}]
    return [EngineRequest(f"r{i}", p, params, a) for i, (p, a) in enumerate(zip(prompts, adapters))]


def run_alone(runner, tokenizer, request: EngineRequest):
    return Engine(runner, tokenizer, EngineConfig(num_seq_slots=1, slot_len=64)).run_all([request])[request.request_id]


def test_request_alone_equals_inside_mixed_batch(runner, tokenizer) -> None:
    requests = mixed_requests()
    alone = [run_alone(runner, tokenizer, r) for r in requests]
    # small step budget: prefill chunks interleave with other requests' decoding
    engine = Engine(runner, tokenizer, EngineConfig(num_seq_slots=6, slot_len=64, max_step_tokens=7))
    together = engine.run_all(requests)
    for request, single in zip(requests, alone):
        batched = together[request.request_id]
        assert batched.token_ids == single.token_ids, request.request_id
        assert batched.finish_reason == "length"
        ours = torch.tensor([e.logprob for e in batched.logprobs])
        torch.testing.assert_close(ours, torch.tensor([e.logprob for e in single.logprobs]), atol=1e-5, rtol=1e-5)
    assert len({tuple(r.token_ids) for r in together.values()}) > 3  # the adapters do change the output
    assert together["r4"].alora_activation == 3 and together["r5"].alora_activation is None
    assert engine.scheduler.num_free_slots == 6
    with pytest.raises(ValueError, match="at least num_seq_slots"):
        EngineConfig(num_seq_slots=8, max_step_tokens=4)


def test_alora_without_invocation_equals_base_in_a_batch(runner, tokenizer) -> None:
    prompt = [40, 41, 42, 43, 44, 45, 46]
    base, alora = EngineRequest("base", prompt, GREEDY), EngineRequest("alora", prompt, GREEDY, {3: 1.0})
    results = Engine(runner, tokenizer, EngineConfig(num_seq_slots=2, slot_len=64)).run_all([base, alora])
    assert results["base"].token_ids == results["alora"].token_ids


def test_alora_in_a_batch_matches_base_before_activation_and_differs_after(runner, tokenizer) -> None:
    prompt = [40, 41, 42, 43, 44, 250, 12, 45, 46, 47]  # invocation at 5 -> active from 4
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True, echo=True, logprobs=1)
    requests = [EngineRequest("base", prompt, params), EngineRequest("alora", prompt, params, {3: 1.0}), mixed_requests()[1]]
    results = Engine(runner, tokenizer, EngineConfig(num_seq_slots=3, slot_len=64, max_step_tokens=4)).run_all(requests)
    base, alora = results["base"].prompt_logprobs, results["alora"].prompt_logprobs
    assert results["alora"].alora_activation == 4
    # entry i is the log-probability of token i given tokens < i: rows up to position 3 see no adapter
    for i in range(1, 5):
        assert abs(base[i].logprob - alora[i].logprob) < 1e-5
    assert all(abs(base[i].logprob - alora[i].logprob) > 1e-4 for i in range(5, len(prompt)))


def test_batched_forward_logits_match_each_sequence_alone(runner) -> None:
    seqs = [([5, 77, 140, 3, 200, 9], {0: 1.0}), ([8, 1, 99, 42], {1: 0.5, 2: 1.0}), ([30, 31, 32, 33, 34, 35, 36, 37, 38], {})]
    expected = [prompt_logits(runner, ids, scales) for ids, scales in seqs]
    kv = runner.allocate_kv(4, 32)
    adapters = [runner.resolve_adapters(ids, s) for ids, s in seqs]
    # prefill all but the last token of each, sequence slots 3, 0, 2, in one pass
    slots, tokens, segments, rows = [3, 0, 2], [], [], []
    for (ids, _), slot in zip(seqs, slots):
        segments.append(Segment(slot, len(tokens), len(ids) - 1, 0))
        rows += range(len(tokens), len(tokens) + len(ids) - 1)
        tokens += ids[:-1]
    scale_rows, active = token_scales([(a, 0, len(ids) - 1) for a, (ids, _) in zip(adapters, seqs)])
    first = runner.logits(tokens, segments, kv, torch.from_numpy(scale_rows), active, rows).cpu()
    # then the last tokens together: a batched decode over slots 0..3 with slot 1 idle
    last = [Segment(slot, i, 1, len(ids) - 1) for i, ((ids, _), slot) in enumerate(zip(seqs, slots))]
    scale_rows, active = token_scales([(a, len(ids) - 1, 1) for a, (ids, _) in zip(adapters, seqs)])
    step = runner.logits([ids[-1] for ids, _ in seqs], last, kv, torch.from_numpy(scale_rows), active, [0, 1, 2]).cpu()
    offset = 0
    for i, ((ids, _), want) in enumerate(zip(seqs, expected)):
        n = len(ids) - 1
        torch.testing.assert_close(first[offset : offset + n], want[:-1], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(step[i], want[-1], atol=1e-5, rtol=1e-5)
        offset += n


def test_seeded_sampling_is_reproducible_in_any_batch(runner, tokenizer) -> None:
    params = SamplingParams(max_tokens=10, temperature=1.0, top_p=0.9, top_k=0, seed=1234, ignore_eos=True)
    target = EngineRequest("t", [5, 77, 140, 3, 200], params, {1: 1.0})
    alone = run_alone(runner, tokenizer, target).token_ids
    others = mixed_requests(SamplingParams(max_tokens=6, temperature=0.9, ignore_eos=True))
    batched = Engine(runner, tokenizer, EngineConfig(num_seq_slots=4, slot_len=64, max_step_tokens=7)).run_all(
        others[:3] + [target] + others[3:]
    )
    assert batched["t"].token_ids == alone
    reseeded = EngineRequest(
        "u", target.prompt_ids, SamplingParams(max_tokens=10, temperature=1.0, top_p=0.9, top_k=0, seed=99, ignore_eos=True), {1: 1.0}
    )
    assert run_alone(runner, tokenizer, reseeded).token_ids != alone


def test_admission_waits_for_a_free_slot(runner, tokenizer) -> None:
    requests = mixed_requests()
    engine = Engine(runner, tokenizer, EngineConfig(num_seq_slots=2, slot_len=32, max_step_tokens=64))
    for r in requests:
        engine.add_request(r)
    engine.step()
    assert len(engine.scheduler.running) == 2 and len(engine.scheduler.waiting) == 4
    finished = []
    while engine.has_work():
        assert len(engine.scheduler.running) <= 2
        finished += [o.request_id for o in engine.step() if o.is_finished]
    assert sorted(finished) == sorted(r.request_id for r in requests)
    assert engine.scheduler.num_free_slots == 2
    for r in requests[:3]:
        assert engine.result(r.request_id) is None  # finished requests leave the engine
    solo = run_alone(runner, tokenizer, requests[5])
    again = Engine(runner, tokenizer, EngineConfig(num_seq_slots=2, slot_len=32)).run_all(requests)
    assert again["r5"].token_ids == solo.token_ids


def test_decoding_continues_while_a_long_prompt_prefills(runner, tokenizer) -> None:
    engine = Engine(runner, tokenizer, EngineConfig(num_seq_slots=2, slot_len=96, max_step_tokens=6))
    engine.add_request(EngineRequest("short", [5, 6], SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)))
    engine.step()
    engine.add_request(EngineRequest("long", list(range(10, 70)), SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)))
    for _ in range(8):  # 60 prompt tokens at <= 5 per step: 'short' decodes on every one of them
        assert [o.request_id for o in engine.step()] == ["short"]


def test_request_errors_change_nothing(runner, tokenizer) -> None:
    engine = Engine(runner, tokenizer, EngineConfig(num_seq_slots=2, slot_len=16))
    with pytest.raises(RequestError, match=r"plus max_tokens \(10\) exceeds the context length \(16\)"):
        engine.add_request(EngineRequest("x", list(range(1, 8)), SamplingParams(max_tokens=10)))
    with pytest.raises(ValueError, match="multiple aLoRAs|slot 9 does not exist"):
        engine.add_request(EngineRequest("x", [1, 2], SamplingParams(max_tokens=1), {9: 1.0}))
    engine.add_request(EngineRequest("ok", [1, 2], SamplingParams(max_tokens=1)))
    with pytest.raises(RequestError, match="already running"):
        engine.add_request(EngineRequest("ok", [1, 2], SamplingParams(max_tokens=1)))
    assert [r.seq.request_id for r in engine._choices.values()] == ["ok"]
    assert len(engine.scheduler.waiting) == 1


def test_one_failing_request_does_not_break_its_batch(runner, tokenizer, monkeypatch) -> None:
    import worker.engine.engine as engine_module

    class Flaky(engine_module.StopMatcher):  # what happens to one request after the batched pass: detokenize, stop
        def feed(self, text: str) -> str:
            if "boom" in self._stops:
                raise RuntimeError("boom")
            return super().feed(text)

    monkeypatch.setattr(engine_module, "StopMatcher", Flaky)
    bad = EngineRequest("bad", [5, 6, 7], SamplingParams(max_tokens=4, temperature=0.5, seed=666, stop=("boom",)))
    good = mixed_requests()[:2]
    results = Engine(runner, tokenizer, EngineConfig(num_seq_slots=3, slot_len=64)).run_all([good[0], bad, good[1]])
    assert results["bad"].finish_reason == "error" and "boom" in results["bad"].error
    for r in good:
        assert results[r.request_id].token_ids == run_alone(runner, tokenizer, r).token_ids


def test_stop_string_across_tokens(runner, tokenizer) -> None:
    request = EngineRequest("s", [5, 77, 140, 3, 200, 9, 31], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    full = run_alone(runner, tokenizer, request)
    prefixes = [tokenizer.decode(full.token_ids[:n]) for n in range(len(full.token_ids) + 1)]
    # a boundary where both neighbouring tokens add text: the stop spans it
    i = next(i for i in range(2, len(prefixes) - 2) if len(prefixes[i]) > len(prefixes[i - 1]) and len(prefixes[i + 1]) > len(prefixes[i]))
    stop = prefixes[i][-1] + prefixes[i + 1][len(prefixes[i])]
    cut = prefixes[-1].find(stop)
    num_tokens = next(n for n, text in enumerate(prefixes) if stop in text)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, stop=("never-there", stop))
    streamed = []
    engine = Engine(runner, tokenizer, EngineConfig(num_seq_slots=1, slot_len=64))
    engine.add_request(EngineRequest("s", request.prompt_ids, params))
    result = engine.result("s")
    while engine.has_work():
        streamed += [o.text for o in engine.step()]
    assert result.finish_reason == "stop"
    assert result.text == prefixes[-1][:cut]
    assert "".join(streamed) == result.text and stop not in result.text
    assert result.token_ids == full.token_ids[:num_tokens]  # up to the token that completed the stop


def test_stream_and_cancel_mid_stream(runner, tokenizer) -> None:
    loop = EngineLoop(Engine(runner, tokenizer, EngineConfig(num_seq_slots=2, slot_len=128)))
    try:
        params = SamplingParams(max_tokens=100, temperature=0, ignore_eos=True)
        stream = loop.submit(EngineRequest("long", [5, 6, 7], params))
        other = loop.submit(EngineRequest("other", [8, 9], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)))
        received = []
        for out in stream:
            received.append(out)
            if len(received) == 3:
                stream.cancel()
        assert received[-1].finish_reason == "cancelled"
        assert 3 <= sum(len(o.token_ids) for o in received) < 100
        other_out = list(other)
        assert other_out[-1].finish_reason == "length" and sum(len(o.token_ids) for o in other_out) == 5
        with pytest.raises(RequestError):
            loop.submit(EngineRequest("bad", [], params))
        again = loop.submit(EngineRequest("long", [5, 6, 7], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)))
        assert [t for o in again for t in o.token_ids] == [t for o in received for t in o.token_ids][:3]
        assert loop.engine.scheduler.num_free_slots == 2
    finally:
        loop.close()


def test_stream_ends_with_the_whole_result_and_a_stale_cancel_is_ignored(runner, tokenizer) -> None:
    loop = EngineLoop(Engine(runner, tokenizer, EngineConfig(num_seq_slots=2, slot_len=64)))
    try:
        echo = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True, echo=True, logprobs=1)
        first = loop.submit(EngineRequest("same-id", [5, 6, 7, 8], echo))
        *_, last = firsts = list(first)
        assert last.finish_reason == "length" and len(last.prompt_logprobs) == 4
        second = loop.submit(EngineRequest("same-id", [5, 6, 7], SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)))
        first.cancel()  # the first request is over: this must not cancel the second
        deltas = list(second)
        assert deltas[-1].finish_reason == "length"
        counters = loop.engine.counters  # every pass ran in an iteration of the loop, which took longer, and its deltas
        assert counters.loop_deltas == len(firsts) + len(deltas) and counters.loop_s > counters.step_s.total > 0
        assert "loraplex_engine_loop_seconds_total" in counters.prometheus()
    finally:
        loop.close()


def test_requests_the_engine_cannot_honour_are_refused(runner) -> None:
    engine = Engine(runner, None, EngineConfig(num_seq_slots=1, slot_len=16))
    with pytest.raises(RequestError, match="stop strings need the model's tokenizer"):
        engine.check(EngineRequest("x", [1, 2], SamplingParams(max_tokens=2, stop=("a",))))
    with pytest.raises(ValueError, match="slot 7 does not exist"):
        engine.check(EngineRequest("x", [1, 2], SamplingParams(max_tokens=2), {7: 1.0}))
    with pytest.raises(ValueError, match="finite"):
        SamplingParams(temperature=float("nan"))
    with pytest.raises(ValueError, match="seed"):
        SamplingParams(seed=-1)


def test_a_quiet_tenants_first_token_does_not_wait_for_a_noisy_tenants_backlog(runner, tokenizer) -> None:
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    noisy = [EngineRequest(f"n{i}", [(7 * i + j) % 200 + 1 for j in range(40)], params, {0: 1.0}, tenant="noisy") for i in range(6)]

    def first_token_step(quiet: EngineRequest) -> tuple[int, list[int]]:
        engine = Engine(runner, tokenizer, EngineConfig(num_seq_slots=8, slot_len=64, max_step_tokens=16))
        for r in [*noisy, quiet]:
            engine.add_request(r)
        step, first, tokens = 0, 0, []
        while engine.has_work():
            step += 1
            for out in engine.step():
                if out.request_id == "q":
                    tokens += out.token_ids
                    first = first or (step if out.token_ids else 0)
        return first, tokens

    same_tenant = EngineRequest("q", [30, 31, 32, 33, 34], params, {0: 1.0}, tenant="noisy")
    shared, _ = first_token_step(same_tenant)
    fair, tokens = first_token_step(EngineRequest("q", same_tenant.prompt_ids, params, {0: 1.0}, tenant="quiet"))
    assert shared >= 15  # as one tenant: behind 240 prompt tokens at 16 a step
    assert fair <= 2  # as another tenant: right after the first noisy chunk
    assert tokens == run_alone(runner, tokenizer, same_tenant).token_ids  # the order changes when, not what


def test_a_qwen3_model_batches_mixed_adapters_as_it_runs_them_alone(tiny_qwen3, tmp_path) -> None:
    targets = ["blk.0.attn_q.weight", "blk.1.attn_v.weight", "blk.0.ffn_down.weight"]
    paths = [write_adapter(tmp_path / f"q{i}.gguf", random_lora(tiny_qwen3, targets, 4, seed=20 + i), arch="qwen3") for i in range(2)]
    runner = ModelRunner.from_paths(tiny_qwen3.path, paths, TEST_DEVICE)
    tokenizer = GGUFTokenizer(GGUFFile(tiny_qwen3.path))
    requests = [
        EngineRequest(f"q{i}", [5 + i, 77, 140, 3, 200, 9], GREEDY, a) for i, a in enumerate([{0: 1.0}, {1: 0.8}, {}, {0: 0.5, 1: 0.5}])
    ]
    together = Engine(runner, tokenizer, EngineConfig(num_seq_slots=4, slot_len=64, max_step_tokens=7)).run_all(requests)
    for request in requests:
        assert together[request.request_id].token_ids == run_alone(runner, tokenizer, request).token_ids
    assert len({tuple(r.token_ids) for r in together.values()}) > 1


def test_a_gemma3_model_keeps_its_sliding_window_in_chunked_prefill_and_mixed_batches(tiny_gemma3, tmp_path) -> None:
    """Prompts three windows long, prefilled 5 tokens a step beside other sequences: the local layers' masks hold."""
    targets = ["blk.0.attn_q.weight", "blk.5.attn_v.weight", "blk.6.attn_output.weight", "blk.1.ffn_down.weight"]
    paths = [write_adapter(tmp_path / f"g{i}.gguf", random_lora(tiny_gemma3, targets, 4, seed=30 + i), arch="gemma3") for i in range(2)]
    runner = ModelRunner.from_paths(tiny_gemma3.path, paths, TEST_DEVICE)
    tokenizer = GGUFTokenizer(GGUFFile(tiny_gemma3.path))
    window = runner.hparams.sliding_window
    prompts = [[(11 * i + 7 * j) % 250 + 3 for j in range(3 * window + i)] for i in range(4)]
    requests = [EngineRequest(f"g{i}", p, GREEDY, a) for i, (p, a) in enumerate(zip(prompts, [{0: 1.0}, {1: 0.8}, {}, {0: 0.5, 1: 0.5}]))]
    together = Engine(runner, tokenizer, EngineConfig(num_seq_slots=4, slot_len=64, max_step_tokens=5)).run_all(requests)
    for request in requests:
        alone = run_alone(runner, tokenizer, request)
        assert together[request.request_id].token_ids == alone.token_ids
        for a, b in zip(together[request.request_id].logprobs, alone.logprobs):
            assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
    assert len({tuple(r.token_ids) for r in together.values()}) > 1
