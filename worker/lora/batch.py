"""A forward pass's per-token adapter scales on the device, shared by every LoRA layer."""

from __future__ import annotations

import torch


class LoRABatch:
    """Set before a pass, cleared after: the scale of every adapter slot for every token (row)."""

    def __init__(self, num_adapter_slots: int) -> None:
        self.num_adapter_slots = num_adapter_slots
        self.token_scales: torch.Tensor | None = None  # [N, num_adapter_slots]
        self.active_slots: frozenset[int] = frozenset()  # adapter slots with a nonzero scale somewhere
        self._column_scales: dict[tuple[int, frozenset[int], torch.dtype], torch.Tensor] = {}

    def set(self, token_scales: torch.Tensor, active_slots: frozenset[int]) -> None:
        self.token_scales = token_scales
        self.active_slots = active_slots
        self._column_scales.clear()

    def clear(self) -> None:
        self.token_scales, self.active_slots = None, frozenset()
        self._column_scales.clear()

    def column_scales(self, column_slots: torch.Tensor, used: frozenset[int], dtype: torch.dtype) -> torch.Tensor:
        """Per-token scale of each rank column [N, R], gathered once per pass for every
        target sharing this column layout (targets with equal layouts share `column_slots`)."""
        key = (id(column_slots), used, dtype)
        scales = self._column_scales.get(key)
        if scales is None:
            scales = self._column_scales[key] = self.token_scales.index_select(1, column_slots).to(dtype)
        return scales
