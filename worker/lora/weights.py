"""A target's adapter weights: each adapter slot's own A and B on the device (alpha/rank
folded into B), added and removed between steps. A pass computes only the adapters
active in it, in one of two ways (chosen per pass by `LoRABatch.segmented`):

- segmented (big passes: prefill): each active adapter over its own runs of rows,
  `y[s:e] += B_j ((A_j x[s:e]) * scale)`, Punica/S-LoRA's SGMV as a loop of GEMMs;
  no FLOP is spent on a token the adapter does not apply to;
- stacked (small passes: decode): one pair of matmuls over a working set, the A and
  B of recently active adapters side by side along the rank axis,
  `y += B_ws ((A_ws x) * column_scales)`, where an adapter not in the batch has scale
  0; or, when the working set's adapters share one rank and each applies to few of the
  pass's rows, the same working set as blocks [G, r, k], each over its own rows in one
  batched matmul (`LoRABatch.groups`; Punica's BGMV), so no FLOP is spent on a token
  an adapter does not apply to. An adapter is copied into the working set when it
  first becomes active (into spare room, so only its own weights move); the set is rebuilt from the active
  adapters only when most of it has gone idle. Decode steps copy nothing while the
  batch's adapters stay the same or shrink.

A DoRA adapter's rows are then rescaled per output channel (`dora_table`): its factor
m / ||W + s B A||_row for each (adapter, scale) is made once from three per-row terms
kept per adapter (worker/formats/dora.py) and cached, never per step.

Either way the cost is that of the adapters in the batch (at most a few times it,
for the idle part of the working set), never of the adapters held, and no unused
adapter's weights are copied per step. Linear: A [r, k], B [d, r]; embedding:
A [V, r], B [d, r]; experts: A [E, r, k], B [E, d, r].
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np
import torch

from worker.formats.dora import row_norms

_MAX_CACHED_STACKS = 4  # active sets per target whose stack is kept (experts)
_MAX_CACHED_FACTORS = 64  # DoRA factors per target, one per (slot, scale)
_MIN_ROOM_COLUMNS = 64  # a working set's spare room, at least


@dataclass
class TargetWeights:
    """One targeted base tensor's adapters."""

    kind: str  # linear | embedding | experts
    pairs: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)  # slot -> (A, B with alpha/rank)
    _stacks: OrderedDict[tuple[int, ...], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=OrderedDict)
    _ws_a: torch.Tensor | None = None  # [capacity, k]: the working set's A, rows [0, columns) in use
    _ws_bt: torch.Tensor | None = None  # [capacity, d]: its B transposed (rows are rank columns)
    _ws_at: dict[int, int] = field(default_factory=dict)  # slot -> first column
    layout: tuple[tuple[int, int], ...] = ()  # (slot, rank) of the working set's columns, in order
    _ws_columns: int = 0  # columns of the working set in use
    finite: dict[int, bool] = field(default_factory=dict)  # slot -> its weights are all finite (only those share matmuls)
    # A decode step's batch usually has the adapters of the step before: the split of its active slots and the
    # working set's views are kept for it (Python work per linear per step grows with the batch's adapters;
    # ~10 ms a step with 16 of them on all 7 linears of 30 layers, before).
    _split_of: tuple[int, ...] | None = None
    _split: tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]] = ((), (), ())
    _ws_of: tuple[int, ...] | None = None
    _ws_views: tuple[torch.Tensor, torch.Tensor] | None = None
    _ws_blocks: tuple[torch.Tensor, torch.Tensor] | None = None
    # DoRA: slot -> (magnitude [d] on the device, row-norm terms [3, d] float64 on the host); the base's bias [d]
    dora: dict[int, tuple[torch.Tensor, np.ndarray]] = field(default_factory=dict)
    bias: torch.Tensor | None = None
    _factors: OrderedDict[tuple[int, float], torch.Tensor] = field(default_factory=OrderedDict)  # (slot, scale) -> [d]
    _table_of: tuple | None = None
    _table: tuple[torch.Tensor, torch.Tensor | None] | None = None

    def add(self, slot: int, a: torch.Tensor, b: torch.Tensor) -> None:
        self.pairs[slot] = (a, b)
        # an adapter with an inf or NaN weight (a bad upload, or one past float16's range) is computed on its own
        # rows only: at scale 0 in a shared matmul, 0 * inf would be NaN in every other request's rows
        self.finite[slot] = bool(torch.isfinite(a).all() and torch.isfinite(b).all())
        self._forget(slot)

    def add_dora(self, slot: int, magnitude: torch.Tensor, terms: np.ndarray, bias: torch.Tensor | None) -> None:
        """`slot` (its pair added) is a DoRA adapter here: magnitude [d] and `row_norm_terms` [3, d]."""
        self.dora[slot] = (magnitude, terms)
        self.bias = bias
        self._forget(slot)

    def remove(self, slot: int) -> None:
        self.pairs.pop(slot, None)
        self.finite.pop(slot, None)
        self.dora.pop(slot, None)
        self._forget(slot)

    def _forget(self, slot: int) -> None:
        self._split_of = None
        self._table_of = self._table = None
        for key in [key for key in self._factors if key[0] == slot]:
            del self._factors[key]
        for key in [key for key in self._stacks if slot in key]:
            del self._stacks[key]
        if slot in self._ws_at:  # its columns would hold another adapter's weights: start again
            self._ws_a = self._ws_bt = None
            self._ws_at, self.layout, self._ws_columns = {}, (), 0
            self._ws_of = None

    def split(self, active: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
        """(used, shared, alone): the slots of `active` this target has, those of them that may
        share a matmul (finite weights) and the others, in `active`'s order."""
        if active != self._split_of:
            used = self.used(active)
            finite = self.finite
            self._split = (used, tuple(slot for slot in used if finite[slot]), tuple(slot for slot in used if not finite[slot]))
            self._split_of = active
        return self._split

    def working_set(self, used: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        """(A_ws [R, k], B_ws [d, R]) of a working set holding every `used` slot (linear targets);
        `layout` says which slot each column block is."""
        if used == self._ws_of:
            return self._ws_views
        missing = [slot for slot in used if slot not in self._ws_at]
        active = sum(self.rank(slot) for slot in used)
        extra = sum(self.rank(slot) for slot in missing)
        idle = self._ws_columns - (active - extra)
        if self._ws_a is None or idle > 2 * active + _MIN_ROOM_COLUMNS:  # mostly idle: rebuild from the active ones
            self._rebuild(used, active)
        elif missing:
            if self._ws_columns + extra > self._ws_a.shape[0]:
                self._rebuild(tuple(slot for slot, _ in self.layout) + tuple(missing), self._ws_columns + extra)
            else:
                for slot in missing:
                    self._put(slot)
        self._ws_of, self._ws_views = used, (self._ws_a[: self._ws_columns], self._ws_bt[: self._ws_columns].t())
        self._ws_blocks = None
        return self._ws_views

    def blocks(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The last `working_set`'s A [G, r, k] and B [G, d, r], one block per `layout` entry
        (all of one rank r), as views."""
        if self._ws_blocks is None:
            count, rank = len(self.layout), self.layout[0][1]
            a, bt = self._ws_a[: self._ws_columns], self._ws_bt[: self._ws_columns]
            self._ws_blocks = (a.view(count, rank, a.shape[1]), bt.view(count, rank, bt.shape[1]).transpose(1, 2))
        return self._ws_blocks

    def _rebuild(self, slots: tuple[int, ...], columns: int) -> None:
        a, b = self.pairs[slots[0]]
        capacity = 2 * columns + _MIN_ROOM_COLUMNS
        self._ws_a = a.new_empty(capacity, a.shape[-1])
        self._ws_bt = b.new_empty(capacity, b.shape[0])
        self._ws_at, self.layout, self._ws_columns = {}, (), 0
        for slot in slots:
            self._put(slot)

    def _put(self, slot: int) -> None:
        """Copy `slot`'s halves into the working set's next free columns."""
        a, b = self.pairs[slot]
        at, rank = self._ws_columns, b.shape[-1]
        self._ws_a[at : at + rank].copy_(a)
        self._ws_bt[at : at + rank].copy_(b.t())
        self._ws_at[slot] = at
        self.layout = (*self.layout, (slot, rank))
        self._ws_columns += rank

    def dora_table(self, keys: tuple[tuple[int, float], ...], dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """For a pass's DoRA (slot, scale) `keys`: (factor [K + 1, d], offset [K + 1, d] or None) where
        row 0 is the identity (ones, zeros) and row i + 1 rescales key i's rows,
        y' = factor * y + offset = m / ||W + s BA|| * (y - bias) + bias; None when no key's slot is
        DoRA on this target. Kept while the pass's keys stay the same."""
        key = (keys, dtype)
        if key == self._table_of:
            return self._table
        table = None
        if any(slot in self.dora for slot, _ in keys):
            factors = [self._factor(slot, scale) for slot, scale in keys]
            ones = torch.ones_like(next(f for f in factors if f is not None))
            factor = torch.stack([ones] + [ones if f is None else f for f in factors])  # float32
            table = (factor.to(dtype), None if self.bias is None else ((1 - factor) * self.bias).to(dtype))
        self._table_of, self._table = key, table
        return table

    def _factor(self, slot: int, scale: float) -> torch.Tensor | None:
        """m / ||W + scale * BA||_row [d] float32 (made once per (slot, scale)), None for a slot not DoRA here."""
        if slot not in self.dora:
            return None
        factor = self._factors.get((slot, scale))
        if factor is None:
            magnitude, terms = self.dora[slot]
            norms = torch.from_numpy(row_norms(terms, scale).astype(np.float32)).to(magnitude.device)
            factor = magnitude / norms
            if len(self._factors) >= _MAX_CACHED_FACTORS:
                self._factors.popitem(last=False)
            self._factors[(slot, scale)] = factor
        else:
            self._factors.move_to_end((slot, scale))
        return factor

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
        return sum(self.slot_nbytes(slot) for slot in self.pairs)

    def slot_nbytes(self, slot: int) -> int:
        """Device bytes of one slot's weights here (its DoRA magnitude included)."""
        a, b = self.pairs[slot]
        magnitude = self.dora[slot][0] if slot in self.dora else None
        return sum(t.numel() * t.element_size() for t in (a, b, magnitude) if t is not None)
