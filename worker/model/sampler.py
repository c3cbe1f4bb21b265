"""Next tokens for a whole batch of logit rows at once: logit bias and repetition penalties,
then greedy, or temperature, top-k, top-p and min-p, each row with its own parameters and
seeded generator. Rows that ask for none of the logit processing pay nothing for it.

`SamplingBatch.build` moves a step's per-row parameters to the device (and draws each
row's uniform number) before the forward pass is queued; `sample` then runs on the
logits without waiting for the device: the caller copies the result to the host once
per step. A row draws one uniform number from its own generator and inverts its CDF,
so a request's tokens depend only on its seed and its own logits, never on its batch.
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from worker.contract.params import SamplingParams

GREEDY_BELOW = 1e-5  # a temperature this small (0 included) overflows logits / T: greedy
NOTHING_ALLOWED = -2  # what `sample` gives a row that no token may follow


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
    penalized: tuple[int, ...] | list[int] = ()  # the penalty window's tokens (SamplingParams.penalty_window)
    allowed: torch.Tensor | None = None  # a grammar's bitmask, int32 words on the host: bit i of word w allows token 32 w + i

    @property
    def is_greedy(self) -> bool:
        return self.params.temperature < GREEDY_BELOW


@dataclass(frozen=True)
class SamplingBatch:
    """A step's sampling parameters on the device, one entry per sampling row."""

    num_rows: int
    banned: tuple[torch.Tensor, torch.Tensor] | None  # (row, token) pairs to mask
    bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None  # (row, token, added) of logit_bias
    penalties: Penalties | None
    drawn: torch.Tensor | None  # [D] rows that sample (the others are greedy)
    temperature: torch.Tensor | None  # [D, 1]
    top_k: torch.Tensor | None  # [D, 1], 0: off
    top_k_max: int
    top_p: torch.Tensor | None  # [D, 1], > 1 where off
    uniform: torch.Tensor | None  # [D] each row's draw in [0, 1), from its own generator

    min_p: torch.Tensor | None = None  # [D, 1], 0 where off
    temperature_last: torch.Tensor | None = None  # [D, 1] bool: filters judged before temperature; None: for no row
    allowed: tuple[torch.Tensor, torch.Tensor] | None = None  # (rows [G], bitmask words [G, W]) of rows under a grammar

    @classmethod
    def build(cls, specs: Sequence[SampleSpec], vocab_size: int, device: torch.device) -> SamplingBatch:
        # a bias of -100 or less is a ban, as OpenAI documents it ("should result in a ban")
        banned = [(i, t) for i, spec in enumerate(specs) for t in spec.banned_ids]
        banned += [(i, t) for i, spec in enumerate(specs) for t, b in spec.params.logit_bias if b <= -100]
        banned_index = None
        if banned:
            rows, cols = zip(*banned)
            banned_index = (torch.tensor(rows, device=device), torch.tensor(cols, device=device))
        biased = [(i, t, b) for i, spec in enumerate(specs) for t, b in spec.params.logit_bias if b > -100]
        bias = None
        if biased:
            rows, cols, added = zip(*biased)
            bias = (
                torch.tensor(rows, device=device),
                torch.tensor(cols, device=device),
                torch.tensor(added, dtype=torch.float32, device=device),
            )
        penalties = Penalties.build(specs, vocab_size, device)
        constrained = [i for i, spec in enumerate(specs) if spec.allowed is not None]
        allowed = None
        if constrained:  # one host-to-device copy for every grammar row of the step
            words = torch.stack([specs[i].allowed for i in constrained]).to(device, non_blocking=True)
            allowed = (torch.tensor(constrained, device=device), words)
        drawn = [i for i, spec in enumerate(specs) if not spec.is_greedy]
        if not drawn:
            return cls(len(specs), banned_index, bias, penalties, None, None, None, 0, None, None, allowed=allowed)
        params = [specs[i].params for i in drawn]
        top_k = [p.top_k if 0 < p.top_k < vocab_size else 0 for p in params]
        return cls(
            num_rows=len(specs),
            banned=banned_index,
            bias=bias,
            penalties=penalties,
            drawn=torch.tensor(drawn, device=device),
            temperature=torch.tensor([[p.temperature] for p in params], device=device),
            top_k=torch.tensor([[k] for k in top_k], device=device) if any(top_k) else None,
            top_k_max=max(top_k),
            top_p=(
                torch.tensor([[p.top_p if p.top_p < 1 else 2.0] for p in params], device=device)
                if any(p.top_p < 1 for p in params)
                else None
            ),
            uniform=torch.cat([torch.rand(1, generator=specs[i].generator, device=device) for i in drawn]),
            min_p=torch.tensor([[p.min_p] for p in params], device=device) if any(p.min_p > 0 for p in params) else None,
            temperature_last=(
                torch.tensor([[p.temperature_last] for p in params], device=device)
                if any(p.temperature_last for p in params)
                else None
            ),
            allowed=allowed,
        )


@dataclass(frozen=True)
class Penalties:
    """Presence, frequency and repeat penalties of the rows that have them, from each row's
    token counts over its penalty window, counted on the device."""

    rows: torch.Tensor  # [R] the rows penalized
    counts: torch.Tensor  # [R, V] each token's count in the row's window
    presence: torch.Tensor  # [R, 1]
    frequency: torch.Tensor  # [R, 1]
    repeat: torch.Tensor | None  # [R, 1], None when every row's is 1

    @classmethod
    def build(cls, specs: Sequence[SampleSpec], vocab_size: int, device: torch.device) -> Penalties | None:
        rows = [i for i, spec in enumerate(specs) if spec.params.has_penalties and len(spec.penalized)]
        if not rows:
            return None
        width = max(len(specs[i].penalized) for i in rows)
        ids = torch.full((len(rows), width), vocab_size, dtype=torch.long)  # vocab_size: padding, counted in a spare column
        for r, i in enumerate(rows):
            ids[r, : len(specs[i].penalized)] = torch.tensor(list(specs[i].penalized), dtype=torch.long)
        ids = ids.to(device).clamp_(0, vocab_size)
        counts = torch.zeros(len(rows), vocab_size + 1, device=device).scatter_add_(
            1, ids, torch.ones(ids.shape, device=device)
        )[:, :vocab_size]
        params = [specs[i].params for i in rows]
        return cls(
            rows=torch.tensor(rows, device=device),
            counts=counts,
            presence=torch.tensor([[p.presence_penalty] for p in params], device=device),
            frequency=torch.tensor([[p.frequency_penalty] for p in params], device=device),
            repeat=(
                torch.tensor([[p.repeat_penalty] for p in params], device=device)
                if any(p.repeat_penalty != 1 for p in params)
                else None
            ),
        )

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        rows = logits.index_select(0, self.rows)
        seen = self.counts > 0
        if self.repeat is not None:
            rows = torch.where(seen, torch.where(rows > 0, rows / self.repeat, rows * self.repeat), rows)
        rows = rows - self.frequency * self.counts - self.presence * seen
        return logits.index_copy(0, self.rows, rows)


def is_distribution(logits: torch.Tensor) -> torch.Tensor:
    """[M] bool: rows with no NaN and no +inf (-inf is a masked token, which is fine)."""
    return ~(torch.isnan(logits) | torch.isposinf(logits)).any(dim=-1)


def sample(logits: torch.Tensor, batch: SamplingBatch, final: list[torch.Tensor] | None = None) -> torch.Tensor:
    """logits [M, V] float32 -> tokens [M] (long, on the logits' device); -1 for a row that is
    not a distribution (NaN or +inf logits), -2 for a row whose bans, biases and grammar leave
    no token at all; either must fail its own request only. With `final` (a list), the logits
    each row was drawn from, after every filter, are appended to it ([M, V]; a greedy row's
    are 0 at its token and -inf elsewhere): llama-server's post-sampling probabilities."""
    valid = is_distribution(logits)
    if batch.bias is not None:
        rows, cols, added = batch.bias
        logits = logits.index_put((rows, cols), added, accumulate=True)
    if batch.penalties is not None:
        logits = batch.penalties.apply(logits)
    if batch.banned is not None:
        logits = logits.index_put(batch.banned, torch.tensor(float("-inf"), device=logits.device))
    if batch.allowed is not None:
        logits = _constrain(logits, *batch.allowed)
    tokens = logits.argmax(dim=-1)
    filtered = None
    if batch.drawn is not None:
        filtered = _filter(logits.index_select(0, batch.drawn), batch)
        tokens = tokens.index_copy(0, batch.drawn, _draw(filtered, batch))
    if final is not None:
        chosen = torch.full_like(logits, float("-inf")).scatter_(1, tokens[:, None], 0.0)
        final.append(chosen if filtered is None else chosen.index_copy(0, batch.drawn, filtered))
    if batch.banned is not None or batch.allowed is not None or batch.bias is not None:
        tokens = torch.where(torch.isfinite(logits).any(dim=-1), tokens, torch.full_like(tokens, NOTHING_ALLOWED))
    return torch.where(valid, tokens, torch.full_like(tokens, -1))


def _constrain(logits: torch.Tensor, rows: torch.Tensor, words: torch.Tensor) -> torch.Tensor:
    """-inf for every token a row's grammar bitmask does not allow."""
    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
    allowed = ((words.unsqueeze(-1) >> shifts) & 1).bool().flatten(1)  # [G, 32 W]
    vocab = logits.shape[-1]
    if allowed.shape[1] < vocab:
        allowed = torch.nn.functional.pad(allowed, (0, vocab - allowed.shape[1]))
    constrained = logits.index_select(0, rows).masked_fill(~allowed[:, :vocab], float("-inf"))
    return logits.index_copy(0, rows, constrained)


def _filter(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """logits [D, V] of rows that sample -> what they are drawn from: top-k, then top-p (a token
    is dropped when the mass before it already reaches top_p; the first always stays), then min-p
    (a token less probable than min_p times the most probable is dropped), judged on the model's
    distribution with temperature applied last as llama.cpp's chain does, or on the tempered one
    (vLLM's order) for rows with `temperature_last` off; dropped tokens are -inf."""
    scaled = logits / batch.temperature
    basis = scaled if batch.temperature_last is None else torch.where(batch.temperature_last, logits, scaled)
    if batch.top_k is not None:
        kth = torch.topk(basis, batch.top_k_max, dim=-1).values.gather(1, batch.top_k.clamp_min(1) - 1)  # [D, 1]
        kth = torch.where(batch.top_k > 0, kth, torch.full_like(kth, float("-inf")))
        basis = basis.masked_fill(basis < kth, float("-inf"))
    if batch.top_p is not None:
        ordered, order = torch.sort(basis, dim=-1, descending=True)
        probs = torch.softmax(ordered, dim=-1)
        drop = (probs.cumsum(dim=-1) - probs) >= batch.top_p
        basis = basis.scatter(1, order, ordered.masked_fill(drop, float("-inf")))
    if batch.min_p is not None:  # p < min_p * p_max <=> logit < max + log(min_p)
        basis = basis.masked_fill(basis < basis.max(dim=-1, keepdim=True).values + torch.log(batch.min_p), float("-inf"))
    return scaled.masked_fill(torch.isneginf(basis), float("-inf"))


def _draw(scaled: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Filtered logits [D, V] -> tokens [D], each row by its own uniform draw."""
    vocab = scaled.shape[-1]
    cdf = torch.softmax(scaled, dim=-1).cumsum(dim=-1)  # [D, V]
    # the first token whose cumulative mass passes u * total: never one of probability 0
    return (cdf <= (batch.uniform * cdf[:, -1])[:, None]).sum(dim=-1).clamp_max(vocab - 1)
