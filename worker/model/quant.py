"""Packed weights for CPU decoding: transforms applied to a loaded model (module replacement).

On the CPU, a batch of 16 decode tokens spends most of its time in fp32 GEMMs
(MKL reaches ~3 GB/s of weights at 16 rows here).

`f16` (the CPU default for quantized GGUF weights): matrices stored in float16
and multiplied by fbgemm's fp16-weight kernel with fp32 activations and fp32
accumulation, ~2x faster than fp32 at 16 rows and ~3x at one. A GGUF Q4/Q5/Q8
weight is a small integer times a float16 scale (plus an offset), so rounding
it to float16 changes it by at most 2^-11 relative: llama.cpp parity holds.
GGUF F32/F16 weights stay as they are.

`q4` (opt-in):
torch's int4 CPU kernel keeps a GGUF Q4_0/Q4_1 matrix's 4-bit codes and
groups of 32 (the kernel wants each group's scale and offset in bfloat16, so
those are rounded) and multiplies with bfloat16 activations, accumulating in
fp32; its result for a row does not depend on the other rows (batch
invariant). Not llama.cpp-exact, so it is opt-in (`weights="q4"`). The Q8_0 output projection goes to torch's int8 kernel with
one scale per row. Norms, attention, softmax, LoRA and the residual stream stay
in fp32.
"""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGMLQuantizationType
from torch import nn

from worker.formats.gguf_file import GGUFFile
from worker.model.moe import ExpertLinear, Routes

Q4_TYPES = (GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1)
GROUP = 32


DENSE_TYPES = (GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16)


def is_available(weights: str) -> bool:
    if weights == "f16":
        return "fbgemm" in torch.backends.quantized.supported_engines
    return hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu") and hasattr(torch.ops.aten, "_weight_int8pack_mm")


class F16Linear(nn.Module):
    """float16 weights, fp32 activations and accumulation (fbgemm, CPU)."""

    is_packed_linear = True

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.packed = torch.ops.quantized.linear_prepack_fp16(weight.detach().float(), None if bias is None else bias.detach().float())
        self.weight_bytes = 2 * weight.numel()  # held inside fbgemm's packed object, not a buffer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.ops.quantized.linear_dynamic_fp16(x.reshape(-1, self.in_features), self.packed)
        return y.view(*x.shape[:-1], self.out_features)


class F16ExpertLinear(nn.Module):
    """MoE experts (worker/model/moe.py) as one fbgemm fp16 matrix per expert."""

    is_expert_linear = True

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.num_experts, self.out_features, self.in_features = weight.shape
        self.packed = [torch.ops.quantized.linear_prepack_fp16(w.detach().float(), None) for w in weight]
        self.weight_bytes = 2 * weight.numel()

    def forward(self, x: torch.Tensor, routes: Routes) -> torch.Tensor:
        out = x.new_empty(x.shape[0], self.out_features)
        for e, start, end in routes.segments:
            out[start:end] = torch.ops.quantized.linear_dynamic_fp16(x[start:end], self.packed[e])
        return out


def pack_f16(model: nn.Module, gguf: GGUFFile) -> int:
    """Replace every linear (and MoE expert set) whose GGUF weight is quantized (the tied
    output too, when the embedding is) with its fp16 form; returns how many were replaced."""
    replaced = 0
    for path, module in list(model.named_modules()):
        if not isinstance(module, (nn.Linear, ExpertLinear)):
            continue
        info = gguf.tensors.get(f"{path}.weight") or (gguf.tensors.get("token_embd.weight") if path == "output" else None)
        if info is None or info.type in DENSE_TYPES:
            continue
        parent, _, child = path.rpartition(".")
        packed = F16ExpertLinear(module.weight) if isinstance(module, ExpertLinear) else F16Linear(module.weight, module.bias)
        setattr(model.get_submodule(parent) if parent else model, child, packed)
        replaced += 1
    return replaced


def _q4_blocks(gguf: GGUFFile, name: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(q [N, K] in 0..15, scale [N, K/32], offset [N, K/32]) with w = scale * q + offset."""
    info = gguf.tensors[name]
    rows, cols = info.ne(1), info.ne(0)
    raw = np.frombuffer(gguf.raw_bytes(info), dtype=np.uint8)
    if info.type == GGMLQuantizationType.Q4_1:
        blocks = raw.reshape(rows, cols // GROUP, 20)
        d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
        m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
        qs = blocks[..., 4:]
    else:
        blocks = raw.reshape(rows, cols // GROUP, 18)
        d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
        m = -8.0 * d
        qs = blocks[..., 2:]
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).reshape(rows, cols)  # low nibbles: first 16 of a block
    return q, d, m


class PackedQ4Linear(nn.Module):
    is_packed_linear = True

    def __init__(self, q: np.ndarray, scale: np.ndarray, offset: np.ndarray, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = q.shape
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(torch.from_numpy(q.astype(np.int32)), 1)
        # kernel: w = (q - 8) * scale + zero  ->  zero = offset + 8 * scale
        sz = np.stack([scale, offset + 8.0 * scale], axis=-1).transpose(1, 0, 2)  # [K/32, N, 2]
        self.register_buffer("packed", packed)
        self.register_buffer("scales_zeros", torch.from_numpy(np.ascontiguousarray(sz)).to(torch.bfloat16))
        self.bias = bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).to(torch.bfloat16)
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(flat, self.packed, GROUP, self.scales_zeros).to(x.dtype)
        if self.bias is not None:
            y = y + self.bias
        return y.view(*x.shape[:-1], self.out_features)


class PackedQ8Linear(nn.Module):
    """int8 weights, one scale per output row (from a dense or Q8_0 matrix)."""

    is_packed_linear = True

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        scale = weight.abs().amax(dim=1).clamp_min(1e-12) / 127.0
        self.register_buffer("weight_int8", torch.round(weight / scale[:, None]).to(torch.int8))
        self.register_buffer("scale", scale.to(torch.bfloat16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).to(torch.bfloat16)
        y = torch.ops.aten._weight_int8pack_mm(flat, self.weight_int8, self.scale).to(x.dtype)
        return y.view(*x.shape[:-1], self.out_features)


def pack_q4(model: nn.Module, gguf: GGUFFile) -> int:
    """Replace the Q4 linears with packed ones and the output projection with int8;
    returns how many modules were replaced. Call before adapters are attached."""
    replaced = 0
    for path, module in list(model.named_modules()):
        if not isinstance(module, nn.Linear):
            continue
        name = f"{path}.weight"
        info = gguf.tensors.get(name)
        if info is not None and info.type in Q4_TYPES and info.ne(0) % GROUP == 0:
            new: nn.Module = PackedQ4Linear(*_q4_blocks(gguf, name), module.bias)
        elif path == "output":
            new = PackedQ8Linear(module.weight.detach().float())
        else:
            continue
        parent, _, child = path.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, new)
        replaced += 1
    return replaced
