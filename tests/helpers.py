"""Small helpers shared by tests."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

import torch

from worker.engine.runner import ModelRunner
from worker.model.device import DeviceConfig

# The whole suite runs on another device with LORAPLEX_TEST_DEVICE=cuda (float32 there too).
TEST_DEVICE = DeviceConfig(device=os.environ.get("LORAPLEX_TEST_DEVICE", "cpu"))


def prompt_logits(runner: ModelRunner, ids: Sequence[int], scales: Mapping[int, float] | None = None) -> torch.Tensor:
    """Logits [T, V] (float32, on the CPU) for every position of `ids` with the given adapter slot scales."""
    kv = runner.allocate_kv(1, len(ids))
    return runner.forward(ids, 0, kv, runner.resolve_adapters(ids, scales or {}), all_logits=True).to("cpu", torch.float32, copy=True)
