"""Attach a worker's adapters to a loaded model: every module some adapter targets is
replaced by a LoRA layer over it (module replacement, as gpt-fast applies quantization)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from torch import nn

from worker.formats.adapter import LoRAAdapter
from worker.lora.backend import LoRABackend, TorchLoRABackend
from worker.lora.batch import LoRABatch
from worker.lora.layers import LoRAEmbedding, LoRAExpertLinear, LoRALinear
from worker.lora.weights import StackedLoRA, stack
from worker.model.device import DeviceConfig


@dataclass
class LoRAState:
    """What attach_lora did: the shared batch mapping, and per adapter slot which targets apply."""

    adapters: list[LoRAAdapter]
    batch: LoRABatch
    applied: dict[int, list[str]]  # adapter slot -> targets wrapped
    ignored: dict[int, list[str]]  # adapter slot -> targets that are not matmuls here (llama.cpp ignores them too)


def attach_lora(model: nn.Module, adapters: Sequence[LoRAAdapter], config: DeviceConfig, backend: LoRABackend | None = None) -> LoRAState:
    """Wrap every module some adapter targets. Adapters must be validated against this base."""
    backend = backend or TorchLoRABackend()
    adapters = list(adapters)
    batch = LoRABatch(len(adapters))
    state = LoRAState(adapters, batch, {i: [] for i in range(len(adapters))}, {i: [] for i in range(len(adapters))})
    layouts: dict[tuple[int, ...], StackedLoRA] = {}
    for target in sorted({t for adapter in adapters for t in adapter.pairs}):
        users = [i for i, adapter in enumerate(adapters) if target in adapter.pairs]
        path = target.removesuffix(".weight")
        try:
            module = model.get_submodule(path) if target.endswith(".weight") else None
        except AttributeError:
            module = None
        if (isinstance(module, nn.Linear) and module.weight.dim() == 2) or getattr(module, "is_packed_linear", False):
            wrapper: nn.Module = LoRALinear(module, stack(adapters, target, False, config, layouts), batch, backend)
        elif getattr(module, "is_expert_linear", False):
            wrapper = LoRAExpertLinear(module, stack(adapters, target, False, config, layouts), batch, backend)
        elif isinstance(module, nn.Embedding):
            wrapper = LoRAEmbedding(module, stack(adapters, target, True, config, layouts), batch, backend)
        else:
            for i in users:
                state.ignored[i].append(target)
            continue
        parent_path, _, child = path.rpartition(".")
        setattr(model.get_submodule(parent_path) if parent_path else model, child, wrapper)
        for i in users:
            state.applied[i].append(target)
    return state
