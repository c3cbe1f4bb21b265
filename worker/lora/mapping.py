"""Request scales -> per-token adapter mapping: which adapter slots apply, at what scale, to
each token of a forward pass. Pure and torch-free (numpy).

A worker holds a changing set of adapters, each in an integer adapter slot. A request
enables some slots with runtime scales; scale 0 is not applied at all. An aLoRA
among them applies only from its activation index on (docs/architecture.md#alora), and not at all
when the prompt lacks its invocation sequence. Per-token scales make stacked
adapters, per-request adapter sets and aLoRA activation one mechanism. A pass's scales
have one column per adapter slot active in it, never one per adapter held: a step's
cost depends on the adapters in its batch, not on how many the worker holds.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from worker.contract.identity import AdapterSlot, ScalesBySlot
from worker.formats.alora import MultipleALoRAError, activation_index
from worker.formats.dora import DoRAStackError


@dataclass(frozen=True)
class RequestAdapters:
    """One request's adapter slots: `scales` apply from position 0, the aLoRA from `activation` on."""

    scales: ScalesBySlot = field(default_factory=dict)  # non-zero, not the aLoRA
    alora_slot: AdapterSlot | None = None  # set only when the prompt invokes it
    alora_scale: float = 0.0
    activation: int | None = None  # the aLoRA's activation index

    @property
    def active_slots(self) -> frozenset[int]:
        return frozenset(self.scales) | (frozenset() if self.alora_slot is None else {self.alora_slot})


def resolve(invocations: Mapping[int, tuple[int, ...] | None] | Sequence[tuple[int, ...] | None], prompt_ids: Sequence[int],
            scales: ScalesBySlot, dora_slots: frozenset[int] = frozenset()) -> RequestAdapters:
    """The mapping of a request enabling `scales` (adapter slot -> scale), given each held slot's
    aLoRA invocation tokens (None: a plain LoRA) and the held slots that are DoRA adapters.
    ValueError for a slot that is not held, MultipleALoRAError for two aLoRAs, DoRAStackError
    for a DoRA adapter with any other (no composition is defined)."""
    held = invocations if isinstance(invocations, Mapping) else dict(enumerate(invocations))
    bad = [slot for slot in scales if slot not in held]
    if bad:
        raise ValueError(f"adapter slot {bad[0]} does not exist (this worker holds {len(held)})")
    enabled = {slot: float(scale) for slot, scale in scales.items() if scale != 0}
    if len(enabled) > 1 and not dora_slots.isdisjoint(enabled):
        raise DoRAStackError()
    aloras = [slot for slot in enabled if held[slot] is not None]
    if len(aloras) > 1:
        raise MultipleALoRAError()
    if not aloras:
        return RequestAdapters(enabled)
    slot = aloras[0]
    scale = enabled.pop(slot)
    activation = activation_index(prompt_ids, held[slot])
    if activation is None:  # not invoked: off for this request
        return RequestAdapters(enabled)
    return RequestAdapters(enabled, slot, scale, activation)


def token_scales(spans: Sequence[tuple[RequestAdapters, int, int]]) -> tuple[np.ndarray, tuple[int, ...]]:
    """Scales [N, A] (float32) for the tokens of `(adapters, start, length)` spans, flattened in
    order, and the A adapter slots active anywhere in them (sorted): column j is slot active[j]."""
    active: set[int] = set()
    for adapters, start, length in spans:
        active.update(adapters.scales)
        if adapters.alora_slot is not None and max(adapters.activation - start, 0) < length:
            active.add(adapters.alora_slot)
    order = tuple(sorted(active))
    column = {slot: j for j, slot in enumerate(order)}
    rows = np.zeros((sum(length for _, _, length in spans), len(order)), dtype=np.float32)
    row = 0
    for adapters, start, length in spans:
        for slot, scale in adapters.scales.items():
            rows[row : row + length, column[slot]] = scale
        if adapters.alora_slot is not None:
            first = max(adapters.activation - start, 0)  # positions before the activation index: off
            if first < length:
                rows[row + first : row + length, column[adapters.alora_slot]] = adapters.alora_scale
        row += length
    return rows, order
