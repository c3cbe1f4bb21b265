"""A forward pass's per-token adapter scales on the device, shared by every LoRA layer."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch

# A pass of at least SEGMENTED_MIN_ROWS tokens whose adapters' runs of rows average at least SEGMENTED_MIN_RUN rows
# (prefill: a prompt's chunk is one run) computes each adapter over its own runs, a matmul per run; a decode step of
# many sequences (runs of one row) goes the way of a small pass instead.
SEGMENTED_MIN_ROWS = 64
SEGMENTED_MIN_RUN = 4
# A smaller pass computes a stack of equal-rank adapters group by group (two batched matmuls, each adapter over its
# own rows) when no adapter has more than GROUPED_MAX_SHARE of the pass's rows and the stacked matmuls would cost at
# least GROUPED_MIN_MACS multiply-adds (rows x stack columns x (in + out features)); below that, the stack's one
# matmul over every row is as fast (2 CPU cores, 16 rows of 16 adapters: rank 16 on a 576 x 576 linear, 4.7M, 1.8x
# faster grouped; on 576 x 192, 3.1M, ~1.2x; rank 8 on 576 x 576, 2.4M, even; grouping costs ~70 us a call there).
GROUPED_MAX_SHARE = 1 / 8
GROUPED_MIN_MACS = 3_000_000
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
        self._groups: dict[tuple, tuple[torch.Tensor, torch.Tensor] | None] = {}
        self._indices: OrderedDict[tuple[int, ...], torch.Tensor] = OrderedDict()  # kept between passes
        self.dora_slots: set[int] = set()  # the held slots that are DoRA adapters (LoRAState keeps it)
        self.has_dora = False  # a DoRA slot is active in this pass: its rows are rescaled after the deltas
        self._dora_rows: DoRARows | None = None

    def set(self, token_scales: torch.Tensor, active: tuple[int, ...], host_scales: np.ndarray | None = None) -> None:
        """`host_scales`: the same scales on the host (they give the runs without a device sync)."""
        self.token_scales, self.active = token_scales, tuple(active)
        self.column = {slot: j for j, slot in enumerate(self.active)}
        self._scales_by_dtype.clear()
        self._column_scales.clear()
        self._groups.clear()
        self.runs = {}
        self._host = host_scales
        self.has_dora, self._dora_rows = bool(self.dora_slots) and not self.dora_slots.isdisjoint(self.active), None
        rows = token_scales.shape[0]
        self.segmented = rows >= SEGMENTED_MIN_ROWS and bool(active) and _run_count(self._host_scales() != 0) * SEGMENTED_MIN_RUN <= rows

    def runs_of(self, slot: int) -> list[tuple[int, int]]:
        """The [start, end) runs of rows where `slot`'s scale is non-zero (found once per pass)."""
        runs = self.runs.get(slot)
        if runs is None:
            runs = self.runs[slot] = _runs(self._host_scales()[:, self.column[slot]] != 0)
        return runs

    def _host_scales(self) -> np.ndarray:
        if self._host is None:
            self._host = self.token_scales.cpu().numpy()
        return self._host

    def groups(self, layout: tuple[tuple[int, int], ...], dtype: torch.dtype, row_macs: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """For a stack of column blocks `layout` ((slot, rank), ...) of one rank whose two matmuls
        cost `row_macs` multiply-adds a row: (rows [G * M], scales [G, M, 1]), where rows
        g*M:(g+1)*M are the rows block g's slot applies to, padded with row 0 at scale 0, and
        scales their scales for it. None when the stack is cheaper: the matmuls are small
        (GROUPED_MIN_MACS), the ranks differ, or one slot applies to more than GROUPED_MAX_SHARE
        of the rows (or to none). Made once per pass for every target sharing that layout."""
        rows = self.token_scales.shape[0]
        if rows * row_macs < GROUPED_MIN_MACS:
            return None
        key = (layout, dtype)
        if key in self._groups:
            return self._groups[key]
        groups = None
        if layout and all(rank == layout[0][1] for _, rank in layout):
            host = self._host_scales()
            columns = [self.column.get(slot) for slot, _ in layout]  # None: an idle block of the working set
            members = [np.flatnonzero(host[:, j]) if j is not None else np.empty(0, np.int64) for j in columns]
            width = max(len(member) for member in members)
            if 0 < width <= GROUPED_MAX_SHARE * rows:
                index = np.zeros((len(layout), width), dtype=np.int64)
                scales = np.zeros((len(layout), width, 1), dtype=np.float32)
                for g, (j, member) in enumerate(zip(columns, members)):
                    if j is not None:
                        index[g, : len(member)] = member
                        scales[g, : len(member), 0] = host[member, j]
                device = self.token_scales.device
                groups = (torch.from_numpy(index.reshape(-1)).to(device), torch.from_numpy(scales).to(device, dtype))
        self._groups[key] = groups
        return groups

    def dora_rows(self) -> DoRARows:
        """Which rows each DoRA (slot, scale) of this pass rescales (found once per pass, on the host)."""
        if self._dora_rows is None:
            host = self._host_scales()
            keys: list[tuple[int, float]] = []
            index = np.zeros(host.shape[0], dtype=np.int64)  # 0: no DoRA; k + 1: keys[k]
            for slot in sorted(self.dora_slots.intersection(self.active)):
                column = host[:, self.column[slot]]
                for scale in np.unique(column[column != 0]):
                    keys.append((slot, float(scale)))
                    index[column == scale] = len(keys)
            runs = [(k, start, end) for k in range(1, len(keys) + 1) for start, end in _runs(index == k)]
            self._dora_rows = DoRARows(tuple(keys), torch.from_numpy(index).to(self.token_scales.device), runs)
        return self._dora_rows

    def clear(self) -> None:
        self.token_scales, self.active, self.column, self.runs, self._host = None, (), {}, {}, None
        self.has_dora, self._dora_rows = False, None
        self._scales_by_dtype.clear()
        self._column_scales.clear()
        self._groups.clear()

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


@dataclass(frozen=True)
class DoRARows:
    """A pass's DoRA rows: `keys` ((slot, scale), ...), `index` [N] (0: no DoRA, k + 1: keys[k]) on the
    device, and the same as runs (k + 1, start, end) on the host."""

    keys: tuple[tuple[int, float], ...]
    index: torch.Tensor
    runs: list[tuple[int, int, int]]


def _run_count(mask: np.ndarray) -> int:
    """The runs of true rows in all the columns of `mask` [N, A] together."""
    return int(mask[0].sum() + (mask[1:] & ~mask[:-1]).sum()) if len(mask) else 0


def _runs(mask: np.ndarray) -> list[tuple[int, int]]:
    """The [start, end) runs where `mask` is true."""
    if not mask.any():
        return []
    edges = np.flatnonzero(np.diff(np.concatenate(([0], mask.astype(np.int8), [0]))))
    return [(int(s), int(e)) for s, e in zip(edges[::2], edges[1::2])]
