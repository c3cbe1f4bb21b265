"""Request scales -> per-token adapter mapping: which adapter slots apply, at what scale, to
each token of a forward pass. Pure and torch-free (numpy).

A worker holds a fixed list of adapters; adapter `i` is adapter slot `i`. A request
enables some slots with runtime scales; scale 0 is not applied at all. An aLoRA
among them applies only from its activation index on (SPEC §4), and not at all
when the prompt lacks its invocation sequence. Per-token scales make stacked
adapters, per-request adapter sets and aLoRA activation one mechanism.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from worker.formats.alora import MultipleALoRAError, activation_index


@dataclass(frozen=True)
class RequestAdapters:
    """One request's adapter slots: `scales` apply from position 0, the aLoRA from `activation` on."""

    scales: Mapping[int, float] = field(default_factory=dict)  # adapter slot -> scale, non-zero, not the aLoRA
    alora_slot: int | None = None  # set only when the prompt invokes it
    alora_scale: float = 0.0
    activation: int | None = None  # the aLoRA's activation index

    @property
    def active_slots(self) -> frozenset[int]:
        return frozenset(self.scales) | (frozenset() if self.alora_slot is None else {self.alora_slot})


def resolve(invocations: Sequence[tuple[int, ...] | None], prompt_ids: Sequence[int], scales: Mapping[int, float]) -> RequestAdapters:
    """The mapping of a request enabling `scales` (adapter slot -> scale), given each slot's aLoRA
    invocation tokens (None: a plain LoRA). ValueError for a slot that does not exist,
    MultipleALoRAError for two aLoRAs."""
    bad = [slot for slot in scales if not 0 <= slot < len(invocations)]
    if bad:
        raise ValueError(f"adapter slot {bad[0]} does not exist (this worker has {len(invocations)})")
    enabled = {slot: float(scale) for slot, scale in scales.items() if scale != 0}
    aloras = [slot for slot in enabled if invocations[slot] is not None]
    if len(aloras) > 1:
        raise MultipleALoRAError()
    if not aloras:
        return RequestAdapters(enabled)
    slot = aloras[0]
    scale = enabled.pop(slot)
    activation = activation_index(prompt_ids, invocations[slot])
    if activation is None:  # not invoked: off for this request
        return RequestAdapters(enabled)
    return RequestAdapters(enabled, slot, scale, activation)


def token_scales(spans: Sequence[tuple[RequestAdapters, int, int]], num_adapter_slots: int) -> tuple[np.ndarray, frozenset[int]]:
    """Scales [N, num_adapter_slots] (float32) for the tokens of `(adapters, start, length)` spans,
    flattened in order, and the slots active anywhere in them."""
    rows = np.zeros((sum(length for _, _, length in spans), num_adapter_slots), dtype=np.float32)
    active: set[int] = set()
    row = 0
    for adapters, start, length in spans:
        for slot, scale in adapters.scales.items():
            rows[row : row + length, slot] = scale
            active.add(slot)
        if adapters.alora_slot is not None:
            first = max(adapters.activation - start, 0)  # positions before the activation index: off
            if first < length:
                rows[row + first : row + length, adapters.alora_slot] = adapters.alora_scale
                active.add(adapters.alora_slot)
        row += length
    return rows, frozenset(active)
