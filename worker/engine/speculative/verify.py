"""What verifying a sequence's drafts takes beyond a decode step, and what it leaves behind.

Each verified row picks its token exactly as decoding would at that position: its own
penalty window (the drafts before it included) and, under a grammar, the grammar's mask after
the drafts before it (the matcher is advanced through them and rolled back). The engine then
keeps the tokens picked while they agree with the drafts, and the first that does not.

For a sampled request the rule is speculative sampling's with a draft that is one token for
certain: the target's token at a position is drawn from its own distribution p, the draft d is
accepted when the draw is d (probability p(d)), and otherwise the draw, which is then
distributed as p without d renormalised, is the token. Row j draws the j-th uniform number
after the sequence's last token; after the step the generator is put back to just after the
draws of the tokens kept. The n-th generated token therefore uses the n-th draw, as in
decoding: a seed gives the same tokens with speculation or without, whatever the drafts were.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from worker.engine.constraint import allowed_tokens


@dataclass(frozen=True)
class DraftedSpan:
    """A sequence's drafts in this step, with the grammar masks at each verified row (or None)
    and its generator's state before the step's draws (or None: greedy)."""

    drafts: tuple[int, ...]
    masks: tuple[torch.Tensor, ...] | None
    generator_state: torch.Tensor | None


def _allows(mask: torch.Tensor, token: int) -> bool:
    return (int(mask[token // 32]) >> (token % 32)) & 1 == 1


def grammar_masks(matcher, drafts: Sequence[int]) -> tuple[list[int], list[torch.Tensor]]:
    """The drafts the grammar allows in a row, and its mask at each of the rows that verify them
    (one more than drafts kept). The matcher ends where it started."""
    masks, kept = [allowed_tokens(matcher)], []
    for token in drafts:
        if not _allows(masks[-1], token) or not matcher.consume_token(token):
            break
        if matcher.is_stopped():  # the grammar is complete: the token after it is the end
            matcher.rollback(1)
            break
        kept.append(token)
        masks.append(allowed_tokens(matcher))
    if kept:
        matcher.rollback(len(kept))
    return kept, masks


def replay_draws(generator: torch.Generator, state: torch.Tensor, num_draws: int) -> None:
    """Put `generator` back to `state`, then advance it by `num_draws` of the sampler's draws
    (one uniform number each, as worker/model/sampler.py draws them)."""
    generator.set_state(state)
    for _ in range(num_draws):
        torch.rand(1, generator=generator, device=generator.device)
