"""Stacked adapter weights: for each targeted base tensor, every adapter's A and B
concatenated along the rank axis (mixed ranks are fine), so one pair of matmuls
serves any mix of adapters in a batch:

    y = W x + B_cat ((A_cat x) * column_scales)

where `column_scales[t, c]` is the runtime scale, for token `t`, of the adapter slot
owning rank column `c` (zero where that adapter is off). `alpha / rank` is folded
into B when stacking. Expert targets (`*_exps`) stack the same way with a leading
expert axis: A [E, R, k], B [E, d, R].
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from worker.formats.adapter import LoRAAdapter
from worker.lora.batch import LoRABatch
from worker.model.device import DeviceConfig, to_torch

_MAX_CACHED_COLUMN_SETS = 256


@dataclass
class StackedLoRA:
    """One target's adapters stacked along the rank axis."""

    a: torch.Tensor  # linear: [R, k]; embedding: [V, R]; experts: [E, R, k]
    b: torch.Tensor  # [d, R] (experts: [E, d, R]), alpha/rank folded in
    column_slots: torch.Tensor  # [R] adapter slot of each rank column, on the compute device
    column_slots_host: list[int]
    adapter_slots: frozenset[int] = field(init=False)
    _columns: dict[frozenset[int], torch.Tensor] = field(init=False, default_factory=dict)
    _active_column_slots: dict[frozenset[int], torch.Tensor] = field(init=False, default_factory=dict)

    def __post_init__(self) -> None:
        self.adapter_slots = frozenset(self.column_slots_host)

    def active_columns(self, active_slots: frozenset[int]) -> torch.Tensor | None:
        """Indices of the rank columns in use (cached per set, so no host->device copy
        per layer call); None when all are."""
        used = self.adapter_slots & active_slots
        if used == self.adapter_slots:
            return None
        cols = self._columns.get(used)
        if cols is None:
            if len(self._columns) >= _MAX_CACHED_COLUMN_SETS:
                self._columns.clear()
                self._active_column_slots.clear()
            index = [i for i, s in enumerate(self.column_slots_host) if s in used]
            cols = self._columns[used] = torch.tensor(index, dtype=torch.long, device=self.b.device)
        return cols

    def select(self, batch: LoRABatch, dtype: torch.dtype) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor] | None:
        """(active column index or None for all, B's active columns, per-token scales [N, R]),
        or None when no adapter of this target is active in the batch."""
        used = self.adapter_slots & batch.active_slots
        if not used:
            return None
        cols = self.active_columns(batch.active_slots)
        if cols is None:
            return None, self.b, batch.column_scales(self.column_slots, used, dtype)
        column_slots = self._active_column_slots.get(used)
        if column_slots is None:
            column_slots = self._active_column_slots[used] = self.column_slots.index_select(0, cols)
        return cols, self.b.index_select(-1, cols), batch.column_scales(column_slots, used, dtype)


def stack(
    adapters: Sequence[LoRAAdapter], target: str, is_embedding: bool, config: DeviceConfig, layouts: dict[tuple[int, ...], StackedLoRA]
) -> StackedLoRA:
    """The adapters' halves for `target` on the device; targets with the same column layout
    (`layouts`, shared across calls) share their column tensors and per-pass scales."""
    a_parts, b_parts, column_slots = [], [], []
    for slot, adapter in enumerate(adapters):
        pair = adapter.pairs.get(target)
        if pair is None:
            continue
        a, b = adapter.load_pair(target)
        a_parts.append(a)
        b_parts.append(b * adapter.scale(pair, 1.0))
        column_slots += [slot] * pair.rank
    a_cat = to_torch(np.concatenate(a_parts, axis=-1 if is_embedding else -2), config)
    b_cat = to_torch(np.concatenate(b_parts, axis=-1), config)
    shared = layouts.get(tuple(column_slots))
    if shared is not None:
        stacked = StackedLoRA(a_cat, b_cat, shared.column_slots, column_slots)
        stacked._columns, stacked._active_column_slots = shared._columns, shared._active_column_slots
        return stacked
    device_slots = torch.tensor(column_slots, dtype=torch.long, device=config.torch_device)
    stacked = layouts[tuple(column_slots)] = StackedLoRA(a_cat, b_cat, device_slots, column_slots)
    return stacked
