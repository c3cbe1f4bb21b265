"""PEFT LoRA on MoE experts -> llama.cpp's `*_exps` pairs (A [E, r, k], B [E, d, r]). Torch-free.

PEFT stores expert LoRA in one of two ways, and both are read:
- one module per expert, as transformers 4 models have them
  (`mlp.experts.3.gate_proj`, Mixtral's `block_sparse_moe.experts.3.w1`/`w3`/`w2`):
  stacked along a new expert axis, as llama.cpp's convert_lora_to_gguf.py does;
- fused expert parameters (`target_parameters`, transformers 5's `mlp.experts.gate_up_proj`
  [E, 2ff, d] and `mlp.experts.down_proj` [E, d, ff]), where one ParamWrapper holds
  A [E*r, in] (expert-major rows) and B [out, r*E] (expert-minor columns), and gate_up's
  B rows are the gate's then the up projection's. Two wrapped parameters of one module
  nest (`experts.lora_A`, `experts.base_layer.lora_A`); which is which is told by shape.
Experts an adapter leaves out get zeros, and experts of different ranks are padded to the
largest, so a target always has one rank; each expert's PEFT scale is folded into its B
relative to the GGUF's alpha / rank.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import numpy as np

from worker.formats.hparams import ModelHParams
from worker.formats.safetensors_file import StoredTensor

_PER_EXPERT = re.compile(r"^model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w3|w2)$")
_FUSED = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts((?:\.base_layer)*)$")
_PROJECTION = {
    "gate_proj": "ffn_gate_exps", "w1": "ffn_gate_exps",
    "up_proj": "ffn_up_exps", "w3": "ffn_up_exps",
    "down_proj": "ffn_down_exps", "w2": "ffn_down_exps",
}

ScaleOf = Callable[[str, int], float]  # (PEFT module or parameter name, its rank) -> PEFT's scale


class ExpertConversionError(ValueError):
    pass


def is_expert_module(module: str) -> bool:
    return bool(_PER_EXPERT.match(module) or _FUSED.match(module))


def expert_pairs(
    modules: dict[str, dict[str, StoredTensor]], hp: ModelHParams, scale_of: ScaleOf, alpha: float
) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """The expert modules of `modules` -> GGUF target -> (A [E, r, k], B [E, d, r]) float32, B scaled
    so that llama.cpp's alpha / r gives each expert its PEFT scale."""
    if not hp.is_moe:
        raise ExpertConversionError(f"the adapter has expert LoRA but the base ({hp.arch}) has no experts")
    experts: dict[str, dict[int, tuple[np.ndarray, np.ndarray]]] = {}  # target -> expert -> (A, scaled B)
    for module, halves in sorted(modules.items()):
        if "lora_A" not in halves or "lora_B" not in halves:
            raise ExpertConversionError(f"module {module} lacks lora_A or lora_B")
        a, b = halves["lora_A"].to_float32(), halves["lora_B"].to_float32()
        if (match := _PER_EXPERT.match(module)) is not None:
            layer, expert, projection = int(match.group(1)), int(match.group(2)), match.group(3)
            if expert >= hp.expert_count:
                raise ExpertConversionError(f"module {module}: expert {expert} is out of range (the base has {hp.expert_count})")
            experts.setdefault(f"blk.{layer}.{_PROJECTION[projection]}.weight", {})[expert] = (a, b * scale_of(module, a.shape[0]))
        else:
            layer = int(_FUSED.match(module).group(1))
            for target, per_expert in _split_fused(module, layer, a, b, hp, scale_of).items():
                experts.setdefault(target, {}).update(per_expert)
    return {target: _stack(target, per_expert, hp, alpha) for target, per_expert in experts.items()}


def _split_fused(
    module: str, layer: int, a: np.ndarray, b: np.ndarray, hp: ModelHParams, scale_of: ScaleOf
) -> dict[str, dict[int, tuple[np.ndarray, np.ndarray]]]:
    num, d, ff = hp.expert_count, hp.embed_dim, hp.expert_ffn_dim
    rows, k = a.shape
    out, cols = b.shape
    if rows % num or cols != rows:
        raise ExpertConversionError(f"module {module}: lora_A {a.shape} and lora_B {b.shape} do not split into {num} experts")
    rank = rows // num
    if (k, out) == (d, 2 * ff):
        parameter, targets = "gate_up_proj", [("ffn_gate_exps", slice(0, ff)), ("ffn_up_exps", slice(ff, 2 * ff))]
    elif (k, out) == (ff, d):
        parameter, targets = "down_proj", [("ffn_down_exps", slice(0, d))]
    else:
        raise ExpertConversionError(
            f"module {module}: lora_A {a.shape} and lora_B {b.shape} fit neither gate_up_proj nor down_proj of this base"
        )
    name = re.sub(r"(\.base_layer)+$", "", module) + "." + parameter
    scale = scale_of(name, rank)
    a_e = a.reshape(num, rank, k)
    b_e = b.reshape(out, rank, num)
    result: dict[str, dict[int, tuple[np.ndarray, np.ndarray]]] = {}
    for projection, rows_of in targets:
        result[f"blk.{layer}.{projection}.weight"] = {e: (a_e[e], b_e[rows_of, :, e] * scale) for e in range(num)}
    return result


def _stack(
    target: str, per_expert: dict[int, tuple[np.ndarray, np.ndarray]], hp: ModelHParams, alpha: float
) -> tuple[np.ndarray, np.ndarray]:
    rank = max(a.shape[0] for a, _ in per_expert.values())
    k = next(iter(per_expert.values()))[0].shape[1]
    d = next(iter(per_expert.values()))[1].shape[0]
    a_all = np.zeros((hp.expert_count, rank, k), np.float32)
    b_all = np.zeros((hp.expert_count, d, rank), np.float32)
    for e, (a, b) in per_expert.items():
        if a.shape[1] != k or b.shape[0] != d or a.shape[0] != b.shape[1]:
            raise ExpertConversionError(f"{target}: expert {e} has lora_A {a.shape} and lora_B {b.shape}, unlike the others")
        a_all[e, : a.shape[0]] = a
        b_all[e, :, : b.shape[1]] = b / (alpha / rank)  # llama.cpp multiplies by alpha / rank
    return a_all, b_all
