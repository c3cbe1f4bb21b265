"""A target's adapter weights: each adapter slot's own A and B on the device (alpha/rank
folded into B), added and removed between steps. A pass computes only the adapters
active in it, in one of two ways (chosen per pass by `LoRABatch.segmented`):

- segmented (big passes: prefill): each active adapter over its own runs of rows,
  `y[s:e] += B_j ((A_j x[s:e]) * scale)`, Punica/S-LoRA's SGMV as a loop of GEMMs;
  no FLOP is spent on a token the adapter does not apply to;
- stacked (small passes: decode): the active adapters' A and B concatenated along
  the rank axis, so one pair of matmuls serves the whole batch,
  `y += B_cat ((A_cat x) * column_scales)`, with the stack cached per active set
  (decode steps reuse it until the set changes).

Either way the cost is that of the adapters in the batch, never of the adapters held,
and no unused adapter's weights are copied. Linear: A [r, k], B [d, r]; embedding:
A [V, r], B [d, r]; experts: A [E, r, k], B [E, d, r].
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import torch

_MAX_CACHED_STACKS = 4  # active sets per target whose stack is kept


@dataclass
class TargetWeights:
    """One targeted base tensor's adapters."""

    kind: str  # linear | embedding | experts
    pairs: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)  # slot -> (A, B with alpha/rank)
    _stacks: OrderedDict[tuple[int, ...], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=OrderedDict)

    def add(self, slot: int, a: torch.Tensor, b: torch.Tensor) -> None:
        self.pairs[slot] = (a, b)
        self._forget(slot)

    def remove(self, slot: int) -> None:
        self.pairs.pop(slot, None)
        self._forget(slot)

    def _forget(self, slot: int) -> None:
        for key in [key for key in self._stacks if slot in key]:
            del self._stacks[key]

    def used(self, active: tuple[int, ...]) -> tuple[int, ...]:
        return tuple(slot for slot in active if slot in self.pairs)

    def rank(self, slot: int) -> int:
        return self.pairs[slot][1].shape[-1]

    def stack(self, used: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        """(A_cat, B_cat) of the `used` slots (linear and experts), cached per set."""
        if len(used) == 1:
            return self.pairs[used[0]]
        stacked = self._stacks.get(used)
        if stacked is None:
            rank_axis = 0 if self.kind == "linear" else 1
            stacked = (torch.cat([self.pairs[s][0] for s in used], dim=rank_axis), torch.cat([self.pairs[s][1] for s in used], dim=-1))
            if len(self._stacks) >= _MAX_CACHED_STACKS:
                self._stacks.popitem(last=False)
            self._stacks[used] = stacked
        else:
            self._stacks.move_to_end(used)
        return stacked

    @property
    def nbytes(self) -> int:
        return sum(a.numel() * a.element_size() + b.numel() * b.element_size() for a, b in self.pairs.values())
