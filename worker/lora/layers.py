"""Layers that add the active adapters' delta to a base linear, embedding or expert matmul.
They hold the pass's `LoRABatch`, their target's `TargetWeights` and the backend they were
given; the model knows nothing of them."""

from __future__ import annotations

import torch
from torch import nn

from worker.lora.backend import LoRABackend
from worker.lora.batch import LoRABatch
from worker.lora.weights import TargetWeights
from worker.model.moe import Routes

DORA_MAX_RUNS = 8  # a pass's DoRA rows in at most this many runs (prefill) are rescaled a slice at a time, else by one gather


class LoRALinear(nn.Module):
    def __init__(self, base: nn.Module, weights: TargetWeights, batch: LoRABatch, backend: LoRABackend) -> None:
        super().__init__()
        self.base, self.weights, self.batch, self.backend = base, weights, batch, backend

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        used, shared, alone = self.weights.split(self.batch.active)  # non-finite weights never share a matmul (TargetWeights.finite)
        if not used:
            return y
        out, flat = y.view(-1, y.shape[-1]), x.reshape(-1, x.shape[-1])
        if self.batch.segmented:
            shared, alone = (), used
        if shared:  # one pair of matmuls over the working set, or one per block of it over its own rows
            a, b = self.weights.working_set(shared)
            groups = self.batch.groups(self.weights.layout, x.dtype, a.shape[0] * (a.shape[1] + b.shape[0]))
            if groups is None:
                self.backend.add_linear(out, flat, a, b, self.batch.column_scales(self.weights.layout, x.dtype))
            else:
                self.backend.add_linear_groups(out, flat, *self.weights.blocks(), *groups)
        scales = self.batch.scales(x.dtype)
        for slot in alone:  # each over its own rows
            a, b = self.weights.pairs[slot]
            column = scales[:, self.batch.column[slot], None]
            for start, end in self.batch.runs_of(slot):
                self.backend.add_linear(out[start:end], flat[start:end], a, b, column[start:end])
        if self.batch.has_dora:
            self._rescale(out)
        return y

    def _rescale(self, out: torch.Tensor) -> None:
        """DoRA: each DoRA row's output channels times m / ||W + s BA||, its bias kept (TargetWeights.dora_table)."""
        rows = self.batch.dora_rows()
        table = self.weights.dora_table(rows.keys, out.dtype)
        if table is None:
            return
        factor, offset = table
        if len(rows.runs) <= DORA_MAX_RUNS:
            for k, start, end in rows.runs:
                out[start:end].mul_(factor[k])
                if offset is not None:
                    out[start:end].add_(offset[k])
            return
        out.mul_(factor.index_select(0, rows.index))  # rows without DoRA: times 1, plus 0
        if offset is not None:
            out.add_(offset.index_select(0, rows.index))


class LoRAEmbedding(nn.Module):
    """Token-embedding delta on the input lookup only (PEFT semantics): a tied
    output projection keeps using the base embedding."""

    def __init__(self, base: nn.Embedding, weights: TargetWeights, batch: LoRABatch, backend: LoRABackend) -> None:
        super().__init__()
        self.base, self.weights, self.batch, self.backend = base, weights, batch, backend

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        y = self.base(ids)
        used = self.weights.used(self.batch.active)
        if not used:
            return y
        scales, flat, out = self.batch.scales(y.dtype), ids.reshape(-1), y.view(-1, y.shape[-1])
        for slot in used:  # one layer: a gather and a matmul per active adapter, over its own rows
            a, b = self.weights.pairs[slot]
            column = scales[:, self.batch.column[slot], None]
            for start, end in self.batch.runs_of(slot):
                self.backend.add_embedding(out[start:end], a.index_select(0, flat[start:end]), b, column[start:end])
        return y


class LoRAExpertLinear(nn.Module):
    """Expert delta (llama.cpp's build_lora_mm_id): each (token, expert) pair's row gets the
    A and B of the expert the router chose, scaled by its token's adapter scales."""

    def __init__(self, base: nn.Module, weights: TargetWeights, batch: LoRABatch, backend: LoRABackend) -> None:
        super().__init__()
        self.base, self.weights, self.batch, self.backend = base, weights, batch, backend

    def forward(self, x: torch.Tensor, routes: Routes) -> torch.Tensor:
        y = self.base(x, routes)
        used = self.weights.used(self.batch.active)
        if not used:
            return y
        a, b = self.weights.stack(used)
        layout = tuple((slot, self.weights.rank(slot)) for slot in used)
        scales = self.batch.column_scales(layout, x.dtype).index_select(0, routes.token)
        self.backend.add_experts(y, x, a, b, scales, routes.segments)
        return y
