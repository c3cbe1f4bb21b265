"""Attach adapters to a loaded model, and detach them, between passes: every module some
adapter targets is replaced by a LoRA layer over it (module replacement, as gpt-fast
applies quantization) the first time an adapter targets it; the layer then serves
whichever adapter slots hold weights for it. A DoRA adapter also leaves, per target, its
magnitude and the row-norm terms of base + delta, computed here from the dequantized base
weight, once (worker/formats/dora.py)."""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from worker.formats.adapter import LoRAAdapter
from worker.formats.dora import row_norm_terms
from worker.lora.backend import LoRABackend, TorchLoRABackend
from worker.lora.batch import LoRABatch
from worker.lora.layers import LoRAEmbedding, LoRAExpertLinear, LoRALinear
from worker.lora.weights import TargetWeights
from worker.model.device import DeviceConfig, to_torch


# target -> (A, B already scaled by alpha/rank, DoRA's (magnitude [d] f32, row-norm terms [3, d] f64, bias [d] f32 or None))
HostHalves = dict[str, tuple[np.ndarray, np.ndarray, tuple | None]]


def host_halves(adapter: LoRAAdapter) -> HostHalves:
    """What `LoRAState.add` needs of `adapter` on the host: every pair read (and dequantized), and a DoRA's
    terms made from the base. Pure numpy, thread-safe: a worker makes it off the step loop."""
    out: HostHalves = {}
    for target in sorted(adapter.pairs):
        a, b = adapter.load_pair(target)
        b = b * adapter.scale(adapter.pairs[target], 1.0)
        dora = None
        if adapter.is_dora:
            w, bias = adapter.load_base(target)
            magnitude = adapter.load_magnitude(target).astype(np.float32)
            dora = (magnitude, row_norm_terms(w, a, b), None if bias is None else bias.astype(np.float32))
        out[target] = (a, b, dora)
    return out


class LoRAState:
    """The model's LoRA layers, the pass's shared batch mapping, and per adapter slot which
    targets apply (`applied`) and which are not matmuls here (`ignored`: llama.cpp ignores them too)."""

    def __init__(self, model: nn.Module, config: DeviceConfig, backend: LoRABackend | None = None) -> None:
        self.model, self.config = model, config
        self.backend = backend or TorchLoRABackend()
        self.batch = LoRABatch()
        self.targets: dict[str, TargetWeights] = {}
        self.applied: dict[int, list[str]] = {}
        self.ignored: dict[int, list[str]] = {}

    def add(self, slot: int, adapter: LoRAAdapter, host: HostHalves | None = None) -> None:
        """Put `adapter` (validated against this base) in `slot`: its halves go to the device. `host`: its
        halves already read and its DoRA terms already made (`host_halves`, off the step loop)."""
        if slot in self.applied:
            raise ValueError(f"adapter slot {slot} is taken")
        host = host_halves(adapter) if host is None else host
        applied, ignored, loaded, dora = [], [], [], []
        for target, (a, b, dora_host) in host.items():
            weights = self.targets.get(target) or self._wrap(target)
            if weights is None:
                ignored.append(target)
                continue
            loaded.append((weights, to_torch(a, self.config), to_torch(b, self.config)))
            applied.append(target)
            if dora_host is not None:
                if weights.kind != "linear":
                    raise ValueError(f"{adapter.path}: DoRA is not supported on tensor '{target}' (a {weights.kind} here)")
                magnitude, terms, bias = dora_host
                device = self.config.torch_device
                dora.append((weights, torch.from_numpy(magnitude).to(device), terms,
                             None if bias is None else torch.from_numpy(bias).to(device)))
        for weights, a, b in loaded:  # all halves made before any is in use
            weights.add(slot, a, b)
        for weights, magnitude, terms, bias in dora:
            weights.add_dora(slot, magnitude, terms, bias)
        if adapter.is_dora:
            self.batch.dora_slots.add(slot)
        self.applied[slot], self.ignored[slot] = applied, ignored

    @property
    def dora_slots(self) -> frozenset[int]:
        """The slots holding a DoRA adapter (a request may not stack one with any other adapter)."""
        return frozenset(self.batch.dora_slots)

    def remove(self, slot: int) -> None:
        for target in self.applied.pop(slot, []):
            self.targets[target].remove(slot)
        self.batch.dora_slots.discard(slot)
        self.ignored.pop(slot, None)

    def nbytes(self, slot: int | None = None) -> int:
        """Device bytes of one slot's weights, or of every adapter held."""
        if slot is None:
            return sum(w.nbytes for w in self.targets.values())
        return sum(self.targets[target].slot_nbytes(slot) for target in self.applied.get(slot, []))

    def _wrap(self, target: str) -> TargetWeights | None:
        """The LoRA layer over `target`'s module (made now), or None when it is no matmul here."""
        path = target.removesuffix(".weight")
        try:
            module = self.model.get_submodule(path) if target.endswith(".weight") else None
        except AttributeError:
            module = None
        if (isinstance(module, nn.Linear) and module.weight.dim() == 2) or getattr(module, "is_packed_linear", False):
            weights, layer = TargetWeights("linear"), LoRALinear
        elif getattr(module, "is_expert_linear", False):
            weights, layer = TargetWeights("experts"), LoRAExpertLinear
        elif isinstance(module, nn.Embedding):
            weights, layer = TargetWeights("embedding"), LoRAEmbedding
        else:
            return None
        parent_path, _, child = path.rpartition(".")
        setattr(
            self.model.get_submodule(parent_path) if parent_path else self.model, child, layer(module, weights, self.batch, self.backend)
        )
        self.targets[target] = weights
        return weights

