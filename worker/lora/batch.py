"""A forward pass's per-token adapter scales on the device, shared by every LoRA layer."""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
import torch

SEGMENTED_MIN_ROWS = 64  # passes of at least this many tokens compute each adapter over its own rows only
_MAX_CACHED_INDICES = 256


class LoRABatch:
    """Set before a pass, cleared after: the scale of every active adapter slot for every token
    (row), and, per slot, the runs of rows it applies to."""

    def __init__(self) -> None:
        self.token_scales: torch.Tensor | None = None  # [N, A]: column j is adapter slot active[j]
        self.active: tuple[int, ...] = ()
        self.column: dict[int, int] = {}
        self.runs: dict[int, list[tuple[int, int]]] = {}  # slot -> [(start, end)] rows where its scale is non-zero
        self.segmented = False  # compute each adapter over its runs (big passes), not all rows against a stack
        self._host = None  # token_scales on the host, for the runs
        self._scales_by_dtype: dict[torch.dtype, torch.Tensor] = {}
        self._column_scales: dict[tuple, torch.Tensor] = {}
        self._indices: OrderedDict[tuple[int, ...], torch.Tensor] = OrderedDict()  # kept between passes

    def set(self, token_scales: torch.Tensor, active: tuple[int, ...], host_scales: np.ndarray | None = None) -> None:
        """`host_scales`: the same scales on the host (they give the runs without a device sync)."""
        self.token_scales, self.active = token_scales, tuple(active)
        self.column = {slot: j for j, slot in enumerate(self.active)}
        self._scales_by_dtype.clear()
        self._column_scales.clear()
        self.segmented = token_scales.shape[0] >= SEGMENTED_MIN_ROWS and bool(active)
        self.runs = {}
        self._host = host_scales

    def runs_of(self, slot: int) -> list[tuple[int, int]]:
        """The [start, end) runs of rows where `slot`'s scale is non-zero (found once per pass)."""
        runs = self.runs.get(slot)
        if runs is None:
            if self._host is None:
                self._host = self.token_scales.cpu().numpy()
            runs = self.runs[slot] = _runs(self._host[:, self.column[slot]] != 0)
        return runs

    def clear(self) -> None:
        self.token_scales, self.active, self.column, self.runs, self._host = None, (), {}, {}, None
        self._scales_by_dtype.clear()
        self._column_scales.clear()

    def scales(self, dtype: torch.dtype) -> torch.Tensor:
        """token_scales in `dtype` with a zero column appended [N, A + 1] (for idle columns of a
        stack), converted once per pass."""
        scales = self._scales_by_dtype.get(dtype)
        if scales is None:
            zero = self.token_scales.new_zeros(self.token_scales.shape[0], 1)
            scales = self._scales_by_dtype[dtype] = torch.cat([self.token_scales, zero], dim=1).to(dtype)
        return scales

    def column_scales(self, layout: tuple[tuple[int, int], ...], dtype: torch.dtype) -> torch.Tensor:
        """Per-token scale of each rank column [N, sum of ranks] of a stack whose column blocks are
        `layout` ((slot, rank), ...); 0 for a slot not active in this pass. Gathered once per pass
        for every target sharing that layout."""
        key = (layout, dtype)
        scales = self._column_scales.get(key)
        if scales is None:
            idle = len(self.active)  # scales()'s zero column
            columns = tuple(self.column.get(slot, idle) for slot, rank in layout for _ in range(rank))
            index = self._indices.get(columns)
            if index is None:
                if len(self._indices) >= _MAX_CACHED_INDICES:
                    self._indices.popitem(last=False)
                index = self._indices[columns] = torch.tensor(columns, dtype=torch.long, device=self.token_scales.device)
            else:
                self._indices.move_to_end(columns)
            scales = self._column_scales[key] = self.scales(dtype).index_select(1, index)
        return scales


def _runs(mask: np.ndarray) -> list[tuple[int, int]]:
    """The [start, end) runs where `mask` is true."""
    if not mask.any():
        return []
    edges = np.flatnonzero(np.diff(np.concatenate(([0], mask.astype(np.int8), [0]))))
    return [(int(s), int(e)) for s, e in zip(edges[::2], edges[1::2])]
