"""LoRA applied to a LoRA-free model by wrapping its linear layers and embedding.

A worker loads a fixed list of adapters; adapter `i` occupies slot `i`. For each
targeted base tensor, the adapters' A and B are stacked along the rank axis
(mixed ranks are fine), so one pair of matmuls serves any mix of adapters:

    y = W x + B_cat ((A_cat x) * col_scales)

where `col_scales[t, c]` is the runtime scale of the slot owning column `c` for
token `t` (zero where that adapter is off). `alpha / rank` is folded into B at
load. Per-token scales make stacked adapters, per-request adapter sets and
aLoRA activation the same mechanism. The matmuls sit behind `LoRABackend`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch
from torch import nn

from worker.formats.adapter import LoRAAdapter
from worker.model.loader import DeviceConfig, to_torch


_MAX_CACHED_COLUMN_SETS = 256


class LoRABatch:
    """Per forward pass: the scale of every slot for every token (row)."""

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self.slot_scales: torch.Tensor | None = None  # [N, num_slots]
        self.active_slots: frozenset[int] = frozenset()  # slots with a nonzero scale somewhere
        self._column_scales: dict[tuple[int, frozenset[int], torch.dtype], torch.Tensor] = {}

    def set(self, slot_scales: torch.Tensor, active_slots: frozenset[int]) -> None:
        self.slot_scales = slot_scales
        self.active_slots = active_slots
        self._column_scales.clear()

    def clear(self) -> None:
        self.slot_scales, self.active_slots = None, frozenset()
        self._column_scales.clear()

    def column_scales(self, col_slot: torch.Tensor, used: frozenset[int], dtype: torch.dtype) -> torch.Tensor:
        """Per-token scale of each rank column [N, R], gathered once per pass for every
        target sharing this column layout (targets with equal layouts share `col_slot`)."""
        key = (id(col_slot), used, dtype)
        scales = self._column_scales.get(key)
        if scales is None:
            scales = self._column_scales[key] = self.slot_scales.index_select(1, col_slot).to(dtype)
        return scales


class LoRABackend(Protocol):
    def add_linear(self, out: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scales: torch.Tensor) -> None:
        """out [N, d] += ((x [N, k] @ a.T [k, R]) * scales [N, R]) @ b.T [R, d]"""

    def add_embedding(self, out: torch.Tensor, a_rows: torch.Tensor, b: torch.Tensor, scales: torch.Tensor) -> None:
        """out [N, d] += (a_rows [N, R] * scales [N, R]) @ b.T [R, d]"""


class TorchLoRABackend:
    """Reference backend: plain torch matmuls, any device."""

    def add_linear(self, out: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scales: torch.Tensor) -> None:
        out.addmm_(torch.mm(x, a.t()).mul_(scales), b.t())

    def add_embedding(self, out: torch.Tensor, a_rows: torch.Tensor, b: torch.Tensor, scales: torch.Tensor) -> None:
        out.addmm_(a_rows * scales, b.t())


@dataclass
class StackedLoRA:
    """One target's adapters stacked along the rank axis."""

    a: torch.Tensor  # linear: [R, k]; embedding: [V, R]
    b: torch.Tensor  # [d, R], alpha/rank folded in
    col_slot: torch.Tensor  # [R] slot of each rank column, on the compute device
    col_slot_cpu: list[int]
    slots: frozenset[int] = field(init=False)
    _columns: dict[frozenset[int], torch.Tensor] = field(init=False, default_factory=dict)
    _active_col_slot: dict[frozenset[int], torch.Tensor] = field(init=False, default_factory=dict)

    def __post_init__(self) -> None:
        self.slots = frozenset(self.col_slot_cpu)

    def active_columns(self, active_slots: frozenset[int]) -> torch.Tensor | None:
        """Indices of the rank columns in use (cached per set, so no host->device copy
        per layer call); None when all are."""
        used = self.slots & active_slots
        if used == self.slots:
            return None
        cols = self._columns.get(used)
        if cols is None:
            if len(self._columns) >= _MAX_CACHED_COLUMN_SETS:
                self._columns.clear()
                self._active_col_slot.clear()
            index = [i for i, s in enumerate(self.col_slot_cpu) if s in used]
            cols = self._columns[used] = torch.tensor(index, dtype=torch.long, device=self.b.device)
        return cols

    def select(self, batch: LoRABatch, dtype: torch.dtype) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor] | None:
        """(active column index or None for all, B's active columns, per-token scales [N, R]),
        or None when no adapter of this target is active in the batch."""
        if not (self.slots & batch.active_slots):
            return None
        used = self.slots & batch.active_slots
        cols = self.active_columns(batch.active_slots)
        if cols is None:
            return None, self.b, batch.column_scales(self.col_slot, used, dtype)
        col_slot = self._active_col_slot.get(used)
        if col_slot is None:
            col_slot = self._active_col_slot[used] = self.col_slot.index_select(0, cols)
        return cols, self.b.index_select(1, cols), batch.column_scales(col_slot, used, dtype)


class LoRALinear(nn.Module):
    def __init__(self, base: nn.Linear, stacked: StackedLoRA, batch: LoRABatch, backend: LoRABackend) -> None:
        super().__init__()
        self.base, self.stacked, self.batch, self.backend = base, stacked, batch, backend

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        selected = self.stacked.select(self.batch, x.dtype)
        if selected is None:
            return y
        cols, b, scales = selected
        a = self.stacked.a if cols is None else self.stacked.a.index_select(0, cols)
        self.backend.add_linear(y.view(-1, y.shape[-1]), x.reshape(-1, x.shape[-1]), a, b, scales)
        return y


class LoRAEmbedding(nn.Module):
    """Token-embedding delta on the input lookup only (PEFT semantics): a tied
    output projection keeps using the base embedding."""

    def __init__(self, base: nn.Embedding, stacked: StackedLoRA, batch: LoRABatch, backend: LoRABackend) -> None:
        super().__init__()
        self.base, self.stacked, self.batch, self.backend = base, stacked, batch, backend

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        y = self.base(ids)
        selected = self.stacked.select(self.batch, y.dtype)
        if selected is None:
            return y
        cols, b, scales = selected
        a_rows = self.stacked.a.index_select(0, ids.reshape(-1))  # [N, R]
        if cols is not None:
            a_rows = a_rows.index_select(1, cols)
        self.backend.add_embedding(y.view(-1, y.shape[-1]), a_rows, b, scales)
        return y


@dataclass
class LoRAState:
    """What attach_lora did: the shared batch mapping, and per slot which targets apply."""

    adapters: list[LoRAAdapter]
    batch: LoRABatch
    applied: dict[int, list[str]]  # slot -> targets wrapped
    ignored: dict[int, list[str]]  # slot -> targets that are not matmuls here (llama.cpp ignores them too)


def _stack(
    adapters: list[LoRAAdapter], target: str, is_embedding: bool, config: DeviceConfig, layouts: dict[tuple[int, ...], StackedLoRA]
) -> StackedLoRA:
    a_parts, b_parts, col_slot = [], [], []
    for slot, adapter in enumerate(adapters):
        pair = adapter.pairs.get(target)
        if pair is None:
            continue
        a, b = adapter.load_pair(target)
        factor = adapter.scale(pair, 1.0)
        a_parts.append(a)
        b_parts.append(b * factor)
        col_slot += [slot] * pair.rank
    a_cat = to_torch(np.concatenate(a_parts, axis=1 if is_embedding else 0), config)
    b_cat = to_torch(np.concatenate(b_parts, axis=1), config)
    shared = layouts.get(tuple(col_slot))
    if shared is not None:  # same layout: share the column tensors and their per-pass scales
        stacked = StackedLoRA(a_cat, b_cat, shared.col_slot, col_slot)
        stacked._columns, stacked._active_col_slot = shared._columns, shared._active_col_slot
        return stacked
    col = torch.tensor(col_slot, dtype=torch.long, device=config.torch_device)
    stacked = layouts[tuple(col_slot)] = StackedLoRA(a_cat, b_cat, col, col_slot)
    return stacked


def attach_lora(
    model: nn.Module, adapters: list[LoRAAdapter], config: DeviceConfig, backend: LoRABackend | None = None
) -> LoRAState:
    """Wrap every module some adapter targets. Adapters must be validated against this base."""
    backend = backend or TorchLoRABackend()
    batch = LoRABatch(len(adapters))
    state = LoRAState(adapters, batch, {i: [] for i in range(len(adapters))}, {i: [] for i in range(len(adapters))})
    targets = sorted({t for adapter in adapters for t in adapter.pairs})
    layouts: dict[tuple[int, ...], StackedLoRA] = {}
    for target in targets:
        users = [i for i, adapter in enumerate(adapters) if target in adapter.pairs]
        path = target.removesuffix(".weight")
        try:
            module = model.get_submodule(path) if target.endswith(".weight") else None
        except AttributeError:
            module = None
        if (isinstance(module, nn.Linear) and module.weight.dim() == 2) or getattr(module, "is_packed_linear", False):
            wrapper: nn.Module = LoRALinear(module, _stack(adapters, target, False, config, layouts), batch, backend)
        elif isinstance(module, nn.Embedding):
            wrapper = LoRAEmbedding(module, _stack(adapters, target, True, config, layouts), batch, backend)
        else:
            for i in users:
                state.ignored[i].append(target)
            continue
        parent_path, _, child = path.rpartition(".")
        setattr(model.get_submodule(parent_path) if parent_path else model, child, wrapper)
        for i in users:
            state.applied[i].append(target)
    return state
