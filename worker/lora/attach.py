"""Attach adapters to a loaded model, and detach them, between passes: every module some
adapter targets is replaced by a LoRA layer over it (module replacement, as gpt-fast
applies quantization) the first time an adapter targets it; the layer then serves
whichever adapter slots hold weights for it."""

from __future__ import annotations


from torch import nn

from worker.formats.adapter import LoRAAdapter
from worker.lora.backend import LoRABackend, TorchLoRABackend
from worker.lora.batch import LoRABatch
from worker.lora.layers import LoRAEmbedding, LoRAExpertLinear, LoRALinear
from worker.lora.weights import TargetWeights
from worker.model.device import DeviceConfig, to_torch


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

    def add(self, slot: int, adapter: LoRAAdapter) -> None:
        """Put `adapter` (validated against this base) in `slot`: its halves go to the device."""
        if slot in self.applied:
            raise ValueError(f"adapter slot {slot} is taken")
        applied, ignored, loaded = [], [], []
        for target in sorted(adapter.pairs):
            weights = self.targets.get(target) or self._wrap(target)
            if weights is None:
                ignored.append(target)
                continue
            a, b = adapter.load_pair(target)
            loaded.append((weights, to_torch(a, self.config), to_torch(b * adapter.scale(adapter.pairs[target], 1.0), self.config)))
            applied.append(target)
        for weights, a, b in loaded:  # all halves made before any is in use
            weights.add(slot, a, b)
        self.applied[slot], self.ignored[slot] = applied, ignored

    def remove(self, slot: int) -> None:
        for target in self.applied.pop(slot, []):
            self.targets[target].remove(slot)
        self.ignored.pop(slot, None)

    def nbytes(self, slot: int | None = None) -> int:
        """Device bytes of one slot's weights, or of every adapter held."""
        if slot is None:
            return sum(w.nbytes for w in self.targets.values())
        return sum(sum(t.numel() * t.element_size() for t in self.targets[target].pairs[slot]) for target in self.applied.get(slot, []))

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

