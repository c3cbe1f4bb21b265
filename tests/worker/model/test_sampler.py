"""Batched sampling over plain logits: each row with its own parameters and seed, no row
depending on the others."""

from __future__ import annotations

import torch

from worker.contract.params import SamplingParams
from worker.model.sampler import SampleSpec, SamplingBatch, make_generator, sample

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
