"""The LoRA kernels behind a small interface: layers get a backend passed in and never
choose one. The torch reference runs on any device."""

from __future__ import annotations

from typing import Protocol

import torch


Segments = list[tuple[int, int, int]]  # (expert, first row, end row)


class LoRABackend(Protocol):
    def add_linear(self, out: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scales: torch.Tensor) -> None:
        """out [N, d] += ((x [N, k] @ a.T [k, R]) * scales [N, R]) @ b.T [R, d]"""

    def add_linear_groups(
        self, out: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, rows: torch.Tensor, scales: torch.Tensor
    ) -> None:
        """For each group g of M rows (rows[g*M:(g+1)*M] of x [N, k]; a row may be in several groups):
        out[rows] += ((x[rows] @ a[g].T) * scales[g]) @ b[g].T, with a [G, r, k], b [G, d, r], scales [G, M, 1]."""

    def add_embedding(self, out: torch.Tensor, a_rows: torch.Tensor, b: torch.Tensor, scales: torch.Tensor) -> None:
        """out [N, d] += (a_rows [N, R] * scales [N, R]) @ b.T [R, d]"""

    def add_experts(
        self, out: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scales: torch.Tensor, segments: Segments
    ) -> None:
        """For each (expert e, start, end) of `segments`, rows start:end of x [P, k] were routed to e:
        out[start:end] += ((x[start:end] @ a[e].T) * scales[start:end]) @ b[e].T, with a [E, R, k], b [E, d, R]."""


class TorchLoRABackend:
    """Reference backend: plain torch matmuls, any device."""

    def add_linear(self, out: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scales: torch.Tensor) -> None:
        out.addmm_(torch.mm(x, a.t()).mul_(scales), b.t())

    def add_linear_groups(
        self, out: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, rows: torch.Tensor, scales: torch.Tensor
    ) -> None:
        # Punica's BGMV as two batched matmuls: each group's rows against its own adapter only
        groups, width = scales.shape[0], scales.shape[1]
        h = torch.bmm(x.index_select(0, rows).view(groups, width, x.shape[1]), a.transpose(1, 2)).mul_(scales)
        out.index_add_(0, rows, torch.bmm(h, b.transpose(1, 2)).view(groups * width, out.shape[1]))

    def add_embedding(self, out: torch.Tensor, a_rows: torch.Tensor, b: torch.Tensor, scales: torch.Tensor) -> None:
        out.addmm_(a_rows * scales, b.t())

    def add_experts(
        self, out: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scales: torch.Tensor, segments: Segments
    ) -> None:
        # Grouped by expert: one pair of matmuls per expert the pass routed to, as the base does
        # (ggml's mul_mat_id); the rows of one expert are contiguous, so every operand is a view.
        for e, start, end in segments:
            out[start:end].addmm_(torch.mm(x[start:end], a[e].t()).mul_(scales[start:end]), b[e].t())
