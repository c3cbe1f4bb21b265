"""DoRA (weight-decomposed LoRA) in the GGUF adapter format: the contract's names and the
row norms it is computed from. Torch-free (numpy); the gateway may import it.

A DoRA adapter is a LoRA adapter (docs/architecture.md#adapters-we-read) with `adapter.lora.dora = true` and, beside
each pair, `NAME.lora_m`: the magnitude, one value per output channel (`ne = [d]`,
PEFT's `lora_magnitude_vector`). For a linear `W` (d x k, bias `b`) at scale `s`
(llama.cpp's `adapter_scale * alpha / rank`):

    y = m / ||W + s B A||_row * (W x + s B (A x)) + b

where `||.||_row` is the L2 norm of each output channel (row) over the input axis, of the
dequantized base weight plus the scaled delta (PEFT's `DoraLinearLayer`: the norm is a
constant, the bias is not rescaled). Only linear targets may carry a magnitude.

The norm is computed for any scale from three per-row terms made once per (adapter,
target): `||W + s BA||^2 = ||W||^2 + 2 s <W, BA> + s^2 ||BA||^2`.
"""

from __future__ import annotations

import numpy as np

DORA_KEY = "adapter.lora.dora"
MAGNITUDE_SUFFIX = ".lora_m"
_CHUNK_ROWS = 1024  # rows of W in float64 at a time


class DoRAStackError(ValueError):
    """A request enabling a DoRA adapter together with any other adapter (no composition is defined)."""

    def __init__(self) -> None:
        super().__init__("Cannot run a DoRA adapter together with other adapters in a single request")


def row_norm_terms(w: np.ndarray, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """[3, d] float64: ||W||^2, <W, BA> and ||BA||^2 of each row, for W (d, k), A (r, k), B (d, r)."""
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    gram = a64 @ a64.T  # [r, r]
    terms = np.empty((3, w.shape[0]), dtype=np.float64)
    for start in range(0, w.shape[0], _CHUNK_ROWS):
        rows = w[start : start + _CHUNK_ROWS].astype(np.float64)
        bs = b64[start : start + _CHUNK_ROWS]
        terms[0, start : start + len(rows)] = np.einsum("ij,ij->i", rows, rows)
        terms[1, start : start + len(rows)] = np.einsum("ij,ij->i", bs, rows @ a64.T)
        terms[2, start : start + len(rows)] = np.einsum("ij,ij->i", bs @ gram, bs)
    return terms


def row_norms(terms: np.ndarray, scale: float) -> np.ndarray:
    """||W + scale * BA||_row from `row_norm_terms`."""
    return np.sqrt(np.maximum(terms[0] + 2.0 * scale * terms[1] + scale * scale * terms[2], 0.0))


def merged_weight(w: np.ndarray, a: np.ndarray, b: np.ndarray, m: np.ndarray, scale: float) -> np.ndarray:
    """The DoRA-merged weight m / ||W + s BA||_row * (W + s BA), float32, computed directly (float64)."""
    full = w.astype(np.float64) + scale * (b.astype(np.float64) @ a.astype(np.float64))
    return ((m.astype(np.float64) / np.linalg.norm(full, axis=1))[:, None] * full).astype(np.float32)
