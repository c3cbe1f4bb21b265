"""Layers that add the stacked adapters' delta to a base linear or embedding. They hold
the pass's `LoRABatch` and the backend they were given; the model knows nothing of them."""

from __future__ import annotations

import torch
from torch import nn

from worker.lora.backend import LoRABackend
from worker.lora.batch import LoRABatch
from worker.lora.weights import StackedLoRA
from worker.model.moe import Routes


class LoRALinear(nn.Module):
    def __init__(self, base: nn.Module, stacked: StackedLoRA, batch: LoRABatch, backend: LoRABackend) -> None:
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


class LoRAExpertLinear(nn.Module):
    """Expert delta (llama.cpp's build_lora_mm_id): each (token, expert) pair's row gets the
    A and B of the expert the router chose, scaled by its token's adapter scales."""

    def __init__(self, base: nn.Module, stacked: StackedLoRA, batch: LoRABatch, backend: LoRABackend) -> None:
        super().__init__()
        self.base, self.stacked, self.batch, self.backend = base, stacked, batch, backend

    def forward(self, x: torch.Tensor, routes: Routes) -> torch.Tensor:
        y = self.base(x, routes)
        selected = self.stacked.select(self.batch, x.dtype)
        if selected is None:
            return y
        cols, b, scales = selected
        a = self.stacked.a if cols is None else self.stacked.a.index_select(1, cols)
        self.backend.add_experts(y, x, a, b, scales.index_select(0, routes.token), routes.segments)
        return y
