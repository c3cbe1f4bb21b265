"""Attach adapters to a loaded model, and detach them, between passes: every module some
adapter targets is replaced by a LoRA layer over it (module replacement, as gpt-fast
applies quantization) the first time an adapter targets it; the layer then serves
whichever adapter slots hold weights for it. A DoRA adapter also leaves, per target, its
magnitude and the row-norm terms of base + delta, computed here from the dequantized base
weight, once (worker/formats/dora.py)."""

from __future__ import annotations

from contextlib import nullcontext

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
# the same on the device: target -> (A, B, DoRA's (magnitude, row-norm terms on the host, bias) or None)
DeviceHalves = dict[str, tuple[torch.Tensor, torch.Tensor, tuple | None]]


def host_halves(adapter: LoRAAdapter) -> HostHalves:
    """What `LoRAState.add` needs of `adapter` on the host: every pair read (and dequantized), and a DoRA's
    terms made from the base. Pure numpy, thread-safe: a worker makes it off the step loop."""
    out: HostHalves = {}
    for target in sorted(adapter.pairs):
        a, b = adapter.load_pair(target)
        if not a.flags.writeable or not a.flags.c_contiguous:  # a view of the file's memory map: kept, it would keep the file open
            a = np.array(a, order="C")
        b = b * adapter.scale(adapter.pairs[target], 1.0)
        dora = None
        if adapter.is_dora:
            w, bias = adapter.load_base(target)
            magnitude = adapter.load_magnitude(target).astype(np.float32)
            dora = (magnitude, row_norm_terms(w, a, b), None if bias is None else bias.astype(np.float32))
        out[target] = (a, b, dora)
    return out


def host_nbytes(host: HostHalves) -> int:
    return sum(a.nbytes + b.nbytes + (0 if d is None else sum(x.nbytes for x in d if x is not None)) for a, b, d in host.values())


def device_halves(host: HostHalves, config: DeviceConfig) -> DeviceHalves:
    """`host` copied to the device (thread-safe: a worker makes it off the step loop; on a GPU on a stream
    of its own, waited for here, so the step loop's stream never waits on the copy)."""
    device = config.torch_device
    stream = torch.cuda.Stream(device) if device.type == "cuda" else None
    with torch.cuda.stream(stream) if stream is not None else nullcontext():
        out: DeviceHalves = {}
        for target, (a, b, dora) in host.items():
            if dora is not None:
                magnitude, terms, bias = dora
                dora = (torch.from_numpy(magnitude).to(device), terms, None if bias is None else torch.from_numpy(bias).to(device))
            out[target] = (_on_device(a, config), _on_device(b, config), dora)
    if stream is not None:
        stream.synchronize()
    return out


def pinned(host: HostHalves) -> HostHalves:
    """`host`'s halves in page-locked memory (a GPU worker's host tier: copied to the device asynchronously)."""
    return {target: (torch.from_numpy(a).pin_memory(), torch.from_numpy(b).pin_memory(), dora)
            for target, (a, b, dora) in host.items()}


def _on_device(half: np.ndarray | torch.Tensor, config: DeviceConfig) -> torch.Tensor:
    if isinstance(half, torch.Tensor):  # pinned: the copy overlaps (on the caller's stream)
        return half.to(device=config.torch_device, dtype=config.torch_dtype, non_blocking=True)
    return to_torch(half, config)


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

    def add(self, slot: int, adapter: LoRAAdapter, host: HostHalves | None = None, device: DeviceHalves | None = None) -> None:
        """Put `adapter` (validated against this base) in `slot`: its halves go to the device. `host`: its
        halves already read and its DoRA terms already made (`host_halves`, off the step loop); `device`:
        already on the device too (`device_halves`), so only the module wiring is left for the step loop."""
        if slot in self.applied:
            raise ValueError(f"adapter slot {slot} is taken")
        if device is None:
            device = device_halves(host_halves(adapter) if host is None else host, self.config)
        applied, ignored, loaded, dora = [], [], [], []
        for target, (a, b, dora_device) in device.items():
            weights = self.targets.get(target) or self._wrap(target)
            if weights is None:
                ignored.append(target)
                continue
            loaded.append((weights, a, b))
            applied.append(target)
            if dora_device is not None:
                if weights.kind != "linear":
                    raise ValueError(f"{adapter.path}: DoRA is not supported on tensor '{target}' (a {weights.kind} here)")
                dora.append((weights, *dora_device))
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

