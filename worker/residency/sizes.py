"""What an adapter takes on the device, counted before it is copied there (the device tier's byte
budget reserves it up front)."""

from __future__ import annotations

import torch

from worker.formats.adapter import LoRAAdapter

MAGNITUDE_ITEM_BYTES = 4  # a DoRA's magnitudes are float32 on the device (worker/lora/attach.py: device_halves)


def device_nbytes(adapter: LoRAAdapter, dtype: torch.dtype) -> int:
    """Bytes `adapter` takes on the device: its halves in `dtype` and a DoRA's magnitudes in float32 (what
    LoRAState.nbytes counts once there, and perhaps a little more: a target that is no matmul here is
    counted too)."""
    item = torch.empty((), dtype=dtype).element_size()
    halves = sum((pair.a.num_elements + pair.b.num_elements) * item for pair in adapter.pairs.values())
    return halves + sum(pair.m.num_elements * MAGNITUDE_ITEM_BYTES for pair in adapter.pairs.values() if pair.m is not None)
