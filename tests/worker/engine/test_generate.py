"""Generation on a tiny model: greedy, seeded sampling, stops, logprobs, request errors."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import TEST_DEVICE, prompt_logits
from tests.tinymodels import invocation_metadata, random_lora, write_adapter
from worker.contract.params import SamplingParams
from worker.engine.generate import RequestError, generate
from worker.engine.runner import ModelRunner
from worker.formats.gguf_file import GGUFFile
from worker.formats.tokenizer import GGUFTokenizer

PROMPT = [5, 77, 140, 3, 200, 9, 31]


@pytest.fixture(scope="module")
def runner(tiny_llama, tmp_path_factory) -> ModelRunner:
    d = tmp_path_factory.mktemp("gen")
    lora = write_adapter(d / "l.gguf", random_lora(tiny_llama, ["blk.0.attn_v.weight", "blk.1.ffn_up.weight"], 4, seed=1))
    alora = write_adapter(d / "a.gguf", random_lora(tiny_llama, ["blk.0.attn_q.weight"], 4, seed=2), metadata=invocation_metadata([31]))
    return ModelRunner.from_paths(tiny_llama.path, [lora, alora], TEST_DEVICE)


@pytest.fixture(scope="module")
def tokenizer(tiny_llama) -> GGUFTokenizer:
    return GGUFTokenizer(GGUFFile(tiny_llama.path))


def test_greedy_follows_argmax_of_full_forward(runner, tokenizer) -> None:
    result = generate(runner, PROMPT, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True), {0: 1.0}, tokenizer)
    assert len(result.token_ids) == 6 and result.finish_reason == "length"
    logits = prompt_logits(runner, PROMPT + result.token_ids, {0: 1.0})
    eog = sorted(tokenizer.eog_ids)
    logits[:, eog] = float("-inf")
    assert result.token_ids == logits[len(PROMPT) - 1 : -1].argmax(-1).tolist()
    assert result.text == tokenizer.decode(result.token_ids)


def test_seeded_sampling_is_reproducible(runner, tokenizer) -> None:
    params = SamplingParams(max_tokens=12, temperature=1.5, top_k=0, top_p=1.0, seed=42, ignore_eos=True)
    first = generate(runner, PROMPT, params, None, tokenizer).token_ids
    assert generate(runner, PROMPT, params, None, tokenizer).token_ids == first
    other = SamplingParams(max_tokens=12, temperature=1.5, top_k=0, top_p=1.0, seed=43, ignore_eos=True)
    assert generate(runner, PROMPT, other, None, tokenizer).token_ids != first


def test_top_k_one_is_greedy(runner, tokenizer) -> None:
    greedy = generate(runner, PROMPT, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True), None, tokenizer)
    top1 = generate(runner, PROMPT, SamplingParams(max_tokens=8, temperature=2.0, top_k=1, seed=1, ignore_eos=True), None, tokenizer)
    assert top1.token_ids == greedy.token_ids


def test_stops_at_end_of_generation(runner, tokenizer, monkeypatch) -> None:
    greedy = generate(runner, PROMPT, SamplingParams(max_tokens=5, temperature=0, ignore_eos=True), None, tokenizer)
    # make the third greedy token an end-of-generation token: generation must stop before it
    monkeypatch.setattr(tokenizer, "eog_ids", frozenset({greedy.token_ids[2]}))
    stopped = generate(runner, PROMPT, SamplingParams(max_tokens=5, temperature=0), None, tokenizer)
    assert stopped.finish_reason == "stop" and stopped.token_ids == greedy.token_ids[:2]
    masked = generate(runner, PROMPT, SamplingParams(max_tokens=5, temperature=0, ignore_eos=True), None, tokenizer)
    assert len(masked.token_ids) == 5 and greedy.token_ids[2] not in masked.token_ids


def test_logprobs_and_echo(runner, tokenizer) -> None:
    result = generate(runner, PROMPT, SamplingParams(max_tokens=3, temperature=0, logprobs=4, echo=True, ignore_eos=True), None, tokenizer)
    assert len(result.logprobs) == 3 and len(result.prompt_logprobs) == len(PROMPT)
    assert result.prompt_logprobs[0] is None
    expected = torch.log_softmax(prompt_logits(runner, PROMPT), -1)  # unmasked, as llama.cpp reports
    for i, entry in enumerate(result.prompt_logprobs[1:]):
        assert entry.token_id == PROMPT[i + 1]
        assert entry.logprob == pytest.approx(float(expected[i, PROMPT[i + 1]]), abs=1e-5)
        assert len(entry.top) == 4 and entry.top[0][1] >= entry.top[-1][1]
    for entry in result.logprobs:  # greedy: the chosen token is the top one, unless it is a masked EOG
        best_allowed = next(token for token, _ in entry.top if token not in tokenizer.eog_ids)
        assert entry.token_id == best_allowed and entry.logprob == pytest.approx(dict(entry.top)[best_allowed])


def test_alora_activation_is_reported(runner, tokenizer) -> None:
    result = generate(runner, PROMPT, SamplingParams(max_tokens=2, temperature=0), {1: 1.0}, tokenizer)
    assert result.alora_activation == PROMPT.index(31) - 1


@pytest.mark.parametrize(
    ("prompt", "params", "message"),
    [
        ([], SamplingParams(max_tokens=1), "the prompt is empty"),
        ([5, 99999], SamplingParams(max_tokens=1), "token id 99999 is out of range"),
        (PROMPT, SamplingParams(max_tokens=200), r"plus max_tokens \(200\) exceeds the model's context length \(128\)"),
        (list(range(10, 138)), SamplingParams(max_tokens=-1), "does not fit the context length"),
    ],
)
def test_bad_requests_fail_before_any_work(runner, prompt, params, message) -> None:
    with pytest.raises(RequestError, match=message):
        generate(runner, prompt, params)


def test_unknown_adapter_slot_is_an_error(runner) -> None:
    with pytest.raises(ValueError, match="adapter slot 5 does not exist"):
        runner.resolve_adapters(PROMPT, {5: 1.0})


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [({"temperature": -1}, "temperature"), ({"top_p": 0}, "top_p"), ({"top_k": -2}, "top_k"), ({"logprobs": 50}, "logprobs")],
)
def test_bad_sampling_params(kwargs, message) -> None:
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_unbounded_generation_stops_at_context_end(runner) -> None:
    prompt = list(range(10, 120))
    result = generate(runner, prompt, SamplingParams(max_tokens=-1, temperature=0, ignore_eos=True))
    assert len(result.token_ids) == 128 - len(prompt) and result.finish_reason == "length"
