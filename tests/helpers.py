"""Small helpers shared by tests."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from worker.runner import ModelRunner


def prompt_logits(runner: ModelRunner, ids: Sequence[int], scales: Mapping[int, float] | None = None) -> torch.Tensor:
    """Logits [T, V] for every position of `ids` with the given adapter slot scales."""
    adapter_scales = runner.adapter_scales(ids, scales or {})
    cache = runner.new_cache(len(ids))
    return runner.forward(ids, 0, cache, adapter_scales.prompt, adapter_scales.active_slots, all_logits=True).clone()
