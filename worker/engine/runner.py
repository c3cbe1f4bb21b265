"""A base model on one device with a fixed adapter set, run on flattened batches of
sequences with per-token adapter scales."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from worker.formats.adapter import LoRAAdapter, load_adapter
from worker.formats.alora import MultipleALoRAError, activation_index
from worker.model.attention import AttentionPlan, KVCache, Segment
from worker.formats.gguf_file import GGUFFile
from worker.lora.layers import LoRABackend, attach_lora
from worker.model.loader import DeviceConfig, load_model


@dataclass(frozen=True)
class AdapterScales:
    """Per-token slot scales (on the host) for a prompt, and for every token generated after it."""

    prompt: torch.Tensor  # [T, num_slots]
    generated: torch.Tensor  # [1, num_slots]
    active_slots: frozenset[int]
    alora_activation: int | None  # index where the request's aLoRA turns on


class ModelRunner:
    def __init__(self, base: GGUFFile, adapters: Sequence[LoRAAdapter], config: DeviceConfig, backend: LoRABackend | None = None) -> None:
        self.config = config
        self.base = base
        self.loaded = load_model(base, config)
        self.model = self.loaded.model
        self.hparams = self.loaded.hparams
        self.adapters = list(adapters)
        self.lora = attach_lora(self.model, self.adapters, config, backend)

    @classmethod
    def from_paths(cls, model_path: str | os.PathLike[str], adapter_paths: Sequence[str | os.PathLike[str]], config: DeviceConfig) -> ModelRunner:
        base = GGUFFile(model_path)
        return cls(base, [load_adapter(p, base) for p in adapter_paths], config)

    @property
    def num_slots(self) -> int:
        return len(self.adapters)

    def adapter_scales(self, prompt_ids: Sequence[int], scales: Mapping[int, float]) -> AdapterScales:
        """Slot scales per token for a request enabling `scales` (slot -> runtime scale).

        Scale-0 slots are not applied. An aLoRA applies from its activation index on,
        and not at all when the prompt lacks its invocation sequence.
        """
        num_tokens = len(prompt_ids)
        prompt = torch.zeros(num_tokens, self.num_slots, dtype=torch.float32)
        generated = torch.zeros(1, self.num_slots, dtype=torch.float32)
        active = set()
        alora_slot, activation = self._alora(prompt_ids, scales)
        for slot, scale in scales.items():
            if scale == 0:
                continue
            start = 0
            if slot == alora_slot:
                if activation is None:
                    continue
                start = activation
            prompt[start:, slot] = scale
            generated[0, slot] = scale
            active.add(slot)
        return AdapterScales(prompt, generated, frozenset(active), activation)

    def alora_activation(self, prompt_ids: Sequence[int], scales: Mapping[int, float]) -> int | None:
        """Where the request's aLoRA turns on; None without one or when the prompt does not invoke it."""
        return self._alora(prompt_ids, scales)[1]

    def _alora(self, prompt_ids: Sequence[int], scales: Mapping[int, float]) -> tuple[int | None, int | None]:
        """(the enabled aLoRA's slot, its activation index); checks the slots exist and at most one aLoRA is on."""
        bad = [slot for slot in scales if not 0 <= slot < self.num_slots]
        if bad:
            raise ValueError(f"adapter slot {bad[0]} does not exist (this worker has {self.num_slots})")
        alora_slots = [s for s, v in scales.items() if v != 0 and self.adapters[s].is_alora]
        if len(alora_slots) > 1:
            raise MultipleALoRAError()
        if not alora_slots:
            return None, None
        slot = alora_slots[0]
        return slot, activation_index(prompt_ids, self.adapters[slot].invocation_tokens)

    def allocate_cache(self, num_slots: int, slot_len: int) -> KVCache:
        hp = self.hparams
        return KVCache.allocate(hp.num_layers, num_slots, hp.num_kv_heads, slot_len, hp.head_dim, self.config.torch_dtype, self.config.torch_device)

    @torch.inference_mode()
    def run(
        self,
        token_ids: Sequence[int],
        segments: Sequence[Segment],
        cache: KVCache,
        slot_scales: torch.Tensor,
        active_slots: frozenset[int],
        logit_rows: Sequence[int],
    ) -> torch.Tensor:
        """One forward pass over every segment's new tokens (flattened in segment order)
        -> float32 logits [len(logit_rows), V] for the requested rows."""
        device = self.config.torch_device
        ids = torch.tensor(token_ids, dtype=torch.long, device=device)
        plan = AttentionPlan.build(segments, device)
        batch = self.lora.batch
        slot_scales = slot_scales.to(device, non_blocking=True)
        batch.set(slot_scales, active_slots)
        try:
            hidden = self.model(ids, cache, plan)  # [N, d]
            rows = list(logit_rows)
            if not rows:  # a pass that only prefills
                return hidden.new_empty(0, self.hparams.vocab_size, dtype=torch.float32)
            if rows != list(range(len(token_ids))):
                index = torch.tensor(rows, dtype=torch.long, device=device)
                hidden = hidden.index_select(0, index)
                batch.set(slot_scales.index_select(0, index), active_slots)  # an adapter may target `output`
            return self.model.logits(hidden)
        finally:
            batch.clear()

    # Single-sequence conveniences (tests, tools): the sequence lives in slot 0.

    def new_cache(self, max_len: int) -> KVCache:
        return self.allocate_cache(1, max_len)

    def forward(
        self,
        token_ids: Sequence[int],
        start_pos: int,
        cache: KVCache,
        slot_scales: torch.Tensor,
        active_slots: frozenset[int],
        all_logits: bool = False,
    ) -> torch.Tensor:
        """Run `token_ids` at positions start_pos.. of slot 0 -> logits [T, V] (or [1, V] for the last)."""
        num_tokens = len(token_ids)
        rows = range(num_tokens) if all_logits else [num_tokens - 1]
        return self.run(token_ids, [Segment(0, 0, num_tokens, start_pos)], cache, slot_scales, active_slots, rows)
