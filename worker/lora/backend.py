"""The LoRA kernels behind a small interface: layers get a backend passed in and never
choose one. The torch reference runs on any device."""

from __future__ import annotations

from typing import Protocol

import torch


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
