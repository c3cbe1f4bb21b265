"""aLoRA activation (docs/architecture.md#alora): where in a prompt an activated LoRA turns on. Torch-free."""

from __future__ import annotations

from collections.abc import Sequence


class MultipleALoRAError(ValueError):
    def __init__(self) -> None:
        super().__init__("Cannot run multiple aLoRAs in a single request")


def find_invocation_start(prompt: Sequence[int], invocation: Sequence[int]) -> int | None:
    """Index of the first token of the last occurrence of `invocation` in `prompt`."""
    n = len(invocation)
    if n == 0:
        return None
    first = invocation[0]
    for start in range(len(prompt) - n, -1, -1):
        if prompt[start] == first and list(prompt[start : start + n]) == list(invocation):
            return start
    return None


def activation_index(prompt: Sequence[int], invocation: Sequence[int]) -> int | None:
    """llama.cpp's rule: tokens from max(s - 1, 0) on use the aLoRA; None: not invoked."""
    start = find_invocation_start(prompt, invocation)
    return None if start is None else max(start - 1, 0)
