"""Next tokens for a whole batch of logit rows at once: greedy, temperature, top-k, top-p,
each row with its own parameters and seeded generator. Nothing here waits for the
device: the caller copies the result to the host once per step.

A row draws one uniform number from its own generator and inverts its CDF, so a
request's tokens depend only on its seed and its own logits, never on its batch.
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from worker.contract.params import SamplingParams

GREEDY_BELOW = 1e-5  # a temperature this small (0 included) overflows logits / T: greedy


def make_generator(seed: int | None, device: torch.device) -> torch.Generator:
    generator = torch.Generator(device=device)
    generator.manual_seed(seed if seed is not None else secrets.randbits(63))
    return generator


@dataclass(frozen=True)
class SampleSpec:
    """How one row picks its token."""

    params: SamplingParams
    generator: torch.Generator
    banned_ids: tuple[int, ...] = ()  # never chosen (ignore_eos: the end-of-generation tokens)

    @property
    def is_greedy(self) -> bool:
        return self.params.temperature < GREEDY_BELOW


def is_distribution(logits: torch.Tensor) -> torch.Tensor:
    """[M] bool: rows with no NaN and no +inf (-inf is a masked token, which is fine)."""
    return ~(torch.isnan(logits) | torch.isposinf(logits)).any(dim=-1)


def sample(logits: torch.Tensor, specs: Sequence[SampleSpec]) -> torch.Tensor:
    """logits [M, V] float32 -> tokens [M] (long, on the logits' device); -1 for a row that is
    not a distribution (NaN or +inf logits), which must fail its own request only."""
    device = logits.device
    valid = is_distribution(logits)
    banned = [(i, t) for i, spec in enumerate(specs) for t in spec.banned_ids]
    if banned:
        rows, cols = zip(*banned)
        index = (torch.tensor(rows, device=device), torch.tensor(cols, device=device))
        logits = logits.index_put(index, torch.tensor(float("-inf"), device=device))
    tokens = logits.argmax(dim=-1)
    drawn = [i for i, spec in enumerate(specs) if not spec.is_greedy]
    if drawn:
        index = torch.tensor(drawn, device=device)
        chosen = _draw(logits.index_select(0, index), [specs[i] for i in drawn])
        tokens = tokens.index_copy(0, index, chosen)
    return torch.where(valid, tokens, torch.full_like(tokens, -1))


def _draw(logits: torch.Tensor, specs: Sequence[SampleSpec]) -> torch.Tensor:
    """logits [M, V] of rows that sample -> tokens [M]: temperature, then top-k, then top-p
    (a token is dropped when the mass before it already reaches top_p; the first always stays)."""
    vocab = logits.shape[-1]
    device = logits.device
    temperature = torch.tensor([s.params.temperature for s in specs], device=device, dtype=logits.dtype)
    scaled = logits / temperature[:, None]
    top_k = [s.params.top_k if 0 < s.params.top_k < vocab else 0 for s in specs]
    if any(top_k):
        k = torch.tensor(top_k, device=device)
        kth = torch.topk(scaled, max(top_k), dim=-1).values.gather(1, (k.clamp_min(1) - 1)[:, None])  # [M, 1]
        kth = torch.where(k[:, None] > 0, kth, torch.full_like(kth, float("-inf")))
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if any(s.params.top_p < 1 for s in specs):
        top_p = torch.tensor([s.params.top_p if s.params.top_p < 1 else 2.0 for s in specs], device=device, dtype=logits.dtype)
        ordered, order = torch.sort(scaled, dim=-1, descending=True)
        probs = torch.softmax(ordered, dim=-1)
        drop = (probs.cumsum(dim=-1) - probs) >= top_p[:, None]
        scaled = scaled.scatter(1, order, ordered.masked_fill(drop, float("-inf")))
    cdf = torch.softmax(scaled, dim=-1).cumsum(dim=-1)  # [M, V]
    uniform = torch.cat([torch.rand(1, generator=s.generator, device=device, dtype=cdf.dtype) for s in specs])  # [M] in [0, 1)
    # the first token whose cumulative mass passes u * total: never one of probability 0
    return (cdf <= (uniform * cdf[:, -1])[:, None]).sum(dim=-1).clamp_max(vocab - 1)
