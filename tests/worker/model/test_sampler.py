"""Batched sampling over plain logits: each row with its own parameters and seed, no row
depending on the others."""

from __future__ import annotations

import torch

from worker.contract.params import SamplingParams
from worker.model.sampler import NOTHING_ALLOWED, SampleSpec, SamplingBatch, make_generator, sample

CPU = torch.device("cpu")
VOCAB = 50


def specs(*params: SamplingParams, banned: tuple[int, ...] = ()) -> list[SampleSpec]:
    return [SampleSpec(p, make_generator(p.seed, CPU), banned) for p in params]


def draw(logits: torch.Tensor, row_specs: list[SampleSpec]) -> list[int]:
    return sample(logits, SamplingBatch.build(row_specs, VOCAB, CPU)).tolist()


def test_each_row_samples_as_if_alone() -> None:
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(0))
    params = [SamplingParams(temperature=0), SamplingParams(temperature=1.0, top_p=0.9, seed=7),
              SamplingParams(temperature=0.7, top_k=5, seed=8), SamplingParams(temperature=1.5, top_k=3, top_p=0.5, seed=9)]
    together = draw(logits, specs(*params))
    alone = [draw(logits[i : i + 1], specs(p))[0] for i, p in enumerate(params)]
    assert together == alone and together[0] == int(logits[0].argmax())
    assert together[2] in torch.topk(logits[2], 5).indices.tolist() and together[3] in torch.topk(logits[3], 3).indices.tolist()
    again = [draw(logits[i : i + 1], specs(p))[0] for i, p in enumerate(params)]
    assert again == alone  # the same seed, the same token


def test_seeds_reproduce_a_sequence_and_differ_from_each_other() -> None:
    logits = torch.zeros(1, VOCAB)  # uniform: any token can come
    def run(seed: int) -> list[int]:
        row = specs(SamplingParams(temperature=1.0, top_p=1.0, seed=seed))
        return [draw(logits, row)[0] for _ in range(20)]
    assert run(1) == run(1) and run(1) != run(2) and len(set(run(1))) > 5


def test_filters_and_bans() -> None:
    logits = torch.arange(VOCAB, dtype=torch.float32).repeat(3, 1)  # token 49 is the most likely
    rows = specs(SamplingParams(temperature=0), SamplingParams(temperature=2.0, top_k=1, seed=1),
                 SamplingParams(temperature=2.0, top_p=1e-6, seed=2), banned=(49, 48))
    assert draw(logits, rows) == [47, 47, 47]  # top-1 and a tiny top-p are greedy; banned tokens never come


def test_a_row_that_is_not_a_distribution_fails_alone() -> None:
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(1))
    logits[1, 3] = float("nan")
    logits[2, 4] = float("inf")
    out = draw(logits, specs(SamplingParams(temperature=0), SamplingParams(temperature=1.0, seed=1), SamplingParams(temperature=0)))
    assert out == [int(logits[0].argmax()), -1, -1]


def _empirical(logits: torch.Tensor, params: SamplingParams, history: list[int], n: int = 4000) -> torch.Tensor:
    """How often each token comes in n draws (one row per draw, each with its own seed)."""
    rows = [SampleSpec(SamplingParams(**{**params.__dict__, "seed": s}), make_generator(s, CPU), (), history) for s in range(n)]
    tokens = sample(logits.expand(n, -1).contiguous(), SamplingBatch.build(rows, VOCAB, CPU))
    return torch.bincount(tokens, minlength=VOCAB).float() / n


def test_logit_bias_of_minus_100_never_picks_the_token_and_plus_100_always_does() -> None:
    logits = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(3))
    top = int(logits.argmax())
    banned = _empirical(logits, SamplingParams(temperature=1.0, top_p=1.0, top_k=0, logit_bias=((top, -100.0),)), [])
    assert banned[top] == 0 and abs(banned.sum() - 1) < 1e-5
    forced = _empirical(logits, SamplingParams(temperature=1.5, top_p=1.0, top_k=0, logit_bias=((7, 100.0),)), [])
    assert forced[7] == 1
    # greedy too, and a small bias moves the distribution as softmax(logits + bias) says
    assert draw(logits, specs(SamplingParams(temperature=0, logit_bias=((7, 100.0),)))) == [7]
    nudged = _empirical(logits, SamplingParams(temperature=1.0, top_p=1.0, top_k=0, logit_bias=((7, 2.0),)), [])
    expected = torch.softmax(logits[0] + 2.0 * (torch.arange(VOCAB) == 7), -1)
    assert abs(nudged[7] - expected[7]) < 0.03


def test_presence_frequency_and_repeat_penalties_follow_their_formulas() -> None:
    """p(token) under each penalty equals softmax of the logits changed as OpenAI and llama.cpp specify."""
    logits = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(4)) * 2
    history = [3, 3, 3, 9, int(logits.argmax())]
    counts = torch.bincount(torch.tensor(history), minlength=VOCAB).float()
    cases = [
        (SamplingParams(temperature=1.0, top_p=1.0, top_k=0, presence_penalty=1.5), logits[0] - 1.5 * (counts > 0)),
        (SamplingParams(temperature=1.0, top_p=1.0, top_k=0, frequency_penalty=0.8), logits[0] - 0.8 * counts),
        (SamplingParams(temperature=1.0, top_p=1.0, top_k=0, repeat_penalty=1.7),
         torch.where(counts > 0, torch.where(logits[0] > 0, logits[0] / 1.7, logits[0] * 1.7), logits[0])),
    ]
    for params, changed in cases:
        freq = _empirical(logits, params, history)
        assert (freq - torch.softmax(changed, -1)).abs().max() < 0.03, params
    # without a window nothing changes: greedy picks the argmax although it is in the history
    assert draw(
        logits, [SampleSpec(SamplingParams(temperature=0, presence_penalty=2.0, penalty_last_n=0), make_generator(0, CPU), (), [])]
    ) == [int(logits.argmax())]
    strong = SamplingParams(temperature=0, presence_penalty=2.0, frequency_penalty=2.0)
    assert draw(logits, [SampleSpec(strong, make_generator(0, CPU), (), history)]) != [int(logits.argmax())]


def test_the_penalty_window_is_the_generated_tokens_or_the_last_n_of_the_whole_context() -> None:
    tokens, prompt = [1, 2, 3, 4, 5, 6], 4
    assert SamplingParams(presence_penalty=1.0).penalty_window(tokens, prompt) == [5, 6]  # OpenAI: generated only
    assert SamplingParams(repeat_penalty=1.1, penalty_last_n=3, penalize_prompt=True).penalty_window(tokens, prompt) == [4, 5, 6]
    assert SamplingParams(repeat_penalty=1.1, penalty_last_n=-1, penalize_prompt=True).penalty_window(tokens, prompt) == tokens
    assert SamplingParams().penalty_window(tokens, prompt) == []  # no penalty: nothing to count


def test_min_p_drops_tokens_below_its_share_of_the_top_probability() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.1, 0.06, 0.04] + [1e-9] * (VOCAB - 5)]))
    freq = _empirical(logits, SamplingParams(temperature=1.0, top_p=1.0, top_k=0, min_p=0.15), [])  # keeps p >= 0.075
    assert freq[3:].sum() == 0 and freq[:3].min() > 0
    kept = torch.tensor([0.5, 0.3, 0.1]) / 0.9
    assert (freq[:3] - kept).abs().max() < 0.03


def test_processing_of_one_row_leaves_the_others_as_they_were() -> None:
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(5))
    plain = [SamplingParams(temperature=1.0, seed=1), SamplingParams(temperature=0)]
    busy = SamplingParams(temperature=1.0, seed=2, logit_bias=((1, 5.0),), presence_penalty=1.0, repeat_penalty=1.3, min_p=0.1)
    rows = [
        SampleSpec(plain[0], make_generator(1, CPU)),
        SampleSpec(busy, make_generator(2, CPU), (), [1, 2]),
        SampleSpec(plain[1], make_generator(0, CPU)),
    ]
    together = sample(logits, SamplingBatch.build(rows, VOCAB, CPU)).tolist()
    assert together[0] == draw(logits[0:1], specs(plain[0]))[0] and together[2] == int(logits[2].argmax())


def test_a_row_with_nothing_left_to_choose_is_flagged_not_given_token_0() -> None:
    logits = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(6))
    none_left = torch.zeros(2, dtype=torch.int32)  # a grammar bitmask allowing nothing
    rows = [SampleSpec(SamplingParams(temperature=0), make_generator(0, CPU), (), (), none_left),
            SampleSpec(SamplingParams(temperature=1.0, seed=1), make_generator(1, CPU), tuple(range(VOCAB)))]
    assert sample(logits, SamplingBatch.build(rows, VOCAB, CPU)).tolist() == [NOTHING_ALLOWED, NOTHING_ALLOWED]
    plain = [SampleSpec(SamplingParams(temperature=0), make_generator(0, CPU), (5,))]
    assert draw(logits[:1], plain) == [int(logits[0].masked_fill(torch.arange(VOCAB) == 5, float("-inf")).argmax())]


def test_min_p_is_judged_before_temperature_as_llama_cpp_does() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.12, 0.08] + [1e-9] * (VOCAB - 4)]))
    hot = _empirical(logits, SamplingParams(temperature=3.0, top_p=1.0, top_k=0, min_p=0.2), [])  # keeps p >= 0.1 before temperature
    assert hot[3:].sum() == 0 and hot[2] > 0


def test_top_p_and_min_p_are_judged_before_temperature_for_llama_cpp_and_after_it_for_vllm() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.12, 0.08] + [1e-9] * (VOCAB - 4)]))
    for filters, dropped in ((dict(top_p=0.75), 2), (dict(top_p=1.0, min_p=0.2), 3)):
        llama = _empirical(logits, SamplingParams(temperature=3.0, top_k=0, **filters), [])
        vllm = _empirical(logits, SamplingParams(temperature=3.0, top_k=0, temperature_last=False, **filters), [])
        assert llama[dropped:].sum() == 0 and llama[:dropped].min() > 0  # on the model's distribution: dropped
        assert vllm[dropped] > 0.1  # on the flatter tempered one: kept
