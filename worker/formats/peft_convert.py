"""Convert a PEFT LoRA adapter (adapter_config.json + adapter_model.safetensors, and the chat
template it ships, if any: worker/formats/peft_template.py) to a llama.cpp GGUF adapter for a
given GGUF base model. Torch-free.

llama.cpp's HF->GGUF conversion permutes the rows of llama q/k weights for
ggml's adjacent-pair rope; the B of q and k gets the same permutation here.
PEFT scales (alpha_pattern, rsLoRA) that llama.cpp's alpha/rank cannot express
are folded into B.

A DoRA adapter (`use_dora`) keeps each linear's `lora_magnitude_vector` as
`NAME.lora_m` (F32, `ne = [d]`, rows permuted as B's) and sets `adapter.lora.dora`
(the layout: worker/formats/adapter.py, worker/formats/dora.py); llama.cpp cannot
load it. DoRA on the token embedding or on MoE experts is refused.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFValueType, GGUFWriter
from gguf.quants import quantize

from worker.formats.adapter import CHAT_TEMPLATE_KEY, INVOCATION_KEY
from worker.formats.dora import DORA_KEY, MAGNITUDE_SUFFIX
from worker.formats.gguf_file import GGUFFile
from worker.formats.hparams import ModelHParams, RopeStyle
from worker.formats.peft_experts import ExpertConversionError, expert_pairs, is_expert_module
from worker.formats.peft_template import TemplateFileError, peft_chat_template
from worker.formats.safetensors_file import StoredTensor, read_safetensors
from worker.formats.tokenizer import GGUFTokenizer

_LAYER_MODULES = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "self_attn.qkv_proj": "attn_qkv",  # phi3's fused projections
    "mlp.gate_up_proj": "ffn_up",
    "mlp.gate": "ffn_gate_inp",  # an MoE router (qwen3moe; Mixtral in transformers 5)
    "block_sparse_moe.gate": "ffn_gate_inp",  # Mixtral's router, as transformers 4 names it
}
_KEY = re.compile(
    r"^(?:base_model\.model\.)?(?P<module>.+?)\.(?P<kind>lora_A|lora_B|lora_embedding_A|lora_embedding_B|lora_magnitude_vector)"
    r"(?:\.(?!weight$|bias$)[^.]+)?(?:\.weight)?$"
)
_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
OUTTYPES = ("auto", "f32", "f16", "bf16")
_GGML = {"f32": GGMLQuantizationType.F32, "f16": GGMLQuantizationType.F16, "bf16": GGMLQuantizationType.BF16}
_SOURCE_OUTTYPE = {"F32": "f32", "F16": "f16", "BF16": "bf16", "F64": "f32"}


class ConversionError(ValueError):
    """The PEFT adapter cannot be represented as a llama.cpp adapter for this base."""


@dataclass(frozen=True)
class ConvertOptions:
    alpha: float | None = None  # overrides lora_alpha from adapter_config.json
    invocation_tokens: tuple[int, ...] | None = None
    invocation_string: str | None = None  # tokenized with the base model's tokenizer
    task_name: str | None = None
    prompt_prefix: str | None = None
    outtype: str = "auto"  # auto keeps each tensor's stored type
    chat_template: str | None = None  # the adapter's chat template; None: the directory's (worker/formats/peft_template.py)


def gguf_target(module: str) -> str | None:
    """HF module path (without base_model.model.) -> GGUF base tensor name."""
    if module == "model.embed_tokens":
        return "token_embd.weight"
    if module == "lm_head":
        return "output.weight"
    match = _LAYER.match(module)
    if match and match.group(2) in _LAYER_MODULES:
        return f"blk.{match.group(1)}.{_LAYER_MODULES[match.group(2)]}.weight"
    return None


def permute_rows_for_adjacent_rope(rows: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's llama q/k permutation (HF rotate-half -> adjacent pairs), on axis 0."""
    d = rows.shape[0]
    return rows.reshape(num_heads, 2, d // num_heads // 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


def _pattern_value(patterns: dict[str, float], module: str, default: float) -> float:
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


def _peft_scale(config: dict, options: ConvertOptions, alpha: float, module: str, rank: int) -> float:
    """The scale PEFT gives `module` (alpha_pattern and rsLoRA included)."""
    module_alpha = (
        alpha
        if options.alpha is not None
        else _pattern_value(config.get("alpha_pattern") or {}, module, float(config.get("lora_alpha", alpha)))
    )
    return module_alpha / (math.sqrt(rank) if config.get("use_rslora") else rank)


def _read_config(peft_dir: Path) -> dict:
    path = peft_dir / "adapter_config.json"
    try:
        config = json.loads(path.read_text())
    except FileNotFoundError as e:
        raise ConversionError(f"{path} not found: is {peft_dir} a PEFT adapter directory?") from e
    except json.JSONDecodeError as e:
        raise ConversionError(f"{path} is not valid JSON: {e}") from e
    if str(config.get("peft_type", "LORA")).upper() != "LORA":
        raise ConversionError(f"peft_type {config.get('peft_type')!r} is not LoRA")
    if config.get("bias", "none") != "none":
        raise ConversionError(f"bias={config['bias']!r}: trained biases are not supported by llama.cpp's LoRA format")
    if config.get("lora_bias"):
        raise ConversionError("lora_bias=True: LoRA B biases are not supported by llama.cpp's LoRA format")
    if config.get("modules_to_save"):
        raise ConversionError(f"modules_to_save {config['modules_to_save']} (fully trained modules) cannot be converted")
    return config


def _collect_pairs(tensors: dict[str, StoredTensor]) -> dict[str, dict[str, StoredTensor]]:
    pairs: dict[str, dict[str, StoredTensor]] = {}
    unsupported = []
    for key, tensor in tensors.items():
        if key.endswith(".base_layer.weight"):
            continue  # copies of base weights (PEFT's save_embedding_layers), not part of the delta
        match = _KEY.match(key)
        if match is None:
            unsupported.append(key)
            continue
        pairs.setdefault(match.group("module"), {})[match.group("kind")] = tensor
    if unsupported:
        raise ConversionError(f"unsupported tensors in the adapter: {', '.join(sorted(unsupported)[:5])}")
    return pairs


def _encode(values: np.ndarray, outtype: str) -> tuple[np.ndarray, GGMLQuantizationType]:
    ggml_type = _GGML[outtype]
    if outtype == "f32":
        return np.ascontiguousarray(values, dtype=np.float32), ggml_type
    if outtype == "f16":
        return np.ascontiguousarray(values, dtype=np.float16), ggml_type
    return quantize(np.ascontiguousarray(values, dtype=np.float32), ggml_type), ggml_type


def _write_tensor(
    writer: GGUFWriter, name: str, tensor: StoredTensor, values: np.ndarray | None, outtype: str, is_rescaled: bool = False
) -> None:
    """Write `values` (float32) or, when None and the type is kept, the stored bits unchanged.

    A rescaled tensor is no longer exactly representable in its 16-bit source type,
    so `auto` writes it as F32."""
    chosen = _SOURCE_OUTTYPE[tensor.dtype] if outtype == "auto" else outtype
    if is_rescaled and outtype == "auto":
        chosen = "f32"
    if values is None and chosen == "bf16" and tensor.dtype == "BF16":
        writer.add_tensor(name, np.ascontiguousarray(tensor.data), raw_shape=tensor.data.shape, raw_dtype=GGMLQuantizationType.BF16)
        return
    data, ggml_type = _encode(tensor.to_float32() if values is None else values, chosen)
    writer.add_tensor(name, data, raw_dtype=ggml_type if chosen == "bf16" else None)


def convert_peft_to_gguf(
    peft_dir: str | os.PathLike[str], base_path: str | os.PathLike[str], out_path: str | os.PathLike[str], options: ConvertOptions
) -> list[str]:
    """Write the GGUF adapter; returns the base tensor names it targets."""
    peft_dir = Path(peft_dir)
    if options.outtype not in OUTTYPES:
        raise ConversionError(f"outtype must be one of {', '.join(OUTTYPES)}")
    config = _read_config(peft_dir)
    weights_path = peft_dir / "adapter_model.safetensors"
    if not weights_path.is_file():
        raise ConversionError(f"{weights_path} not found (only safetensors adapters are supported)")
    base = GGUFFile(base_path)
    hp = ModelHParams.from_gguf(base)
    alpha = float(options.alpha if options.alpha is not None else config.get("lora_alpha", 8))
    if alpha <= 0:
        raise ConversionError(f"lora_alpha must be positive, got {alpha}")
    invocation = _checked_invocation(options, config, base, hp)
    pairs = _collect_pairs(read_safetensors(weights_path))
    is_dora = bool(config.get("use_dora"))
    _check_dora(pairs, is_dora)

    def scale_of(module: str, rank: int) -> float:  # PEFT's scale of `module`
        return _peft_scale(config, options, alpha, module, rank)

    def fold_of(module: str, rank: int) -> float:  # what B takes in of that scale beyond llama.cpp's alpha / rank
        return scale_of(module, rank) / (alpha / rank)

    pairs, experts = _split_experts(pairs, hp, scale_of, alpha)
    try:
        chat_template = options.chat_template if options.chat_template is not None else peft_chat_template(peft_dir)
    except TemplateFileError as e:
        raise ConversionError(str(e)) from e
    writer = _open_writer(out_path, hp.arch, alpha, is_dora, options, invocation, chat_template)
    targets = [_write_module(writer, module, pairs[module], hp, fold_of, options.outtype, is_dora)
               for module in sorted(pairs, key=gguf_target)]
    for target, (a_values, b_values) in sorted(experts.items()):  # already scaled: written as F32 unless told otherwise
        _write_tensor(writer, f"{target}.lora_a", StoredTensor("F32", a_values), None, options.outtype)
        _write_tensor(writer, f"{target}.lora_b", StoredTensor("F32", b_values), None, options.outtype)
        targets.append(target)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return targets


def _checked_invocation(options: ConvertOptions, config: dict, base: GGUFFile, hp: ModelHParams) -> tuple[int, ...] | None:
    """The aLoRA invocation tokens (`_invocation_tokens`), each checked to be in the base's vocabulary."""
    invocation = _invocation_tokens(options, config, base)
    bad = [t for t in invocation or () if not 0 <= t < hp.vocab_size]
    if bad:
        raise ConversionError(f"invocation token {bad[0]} is out of range (vocabulary size {hp.vocab_size})")
    return invocation


def _split_experts(
    pairs: dict[str, dict[str, StoredTensor]], hp: ModelHParams, scale_of: Callable[[str, int], float], alpha: float
) -> tuple[dict[str, dict[str, StoredTensor]], dict[str, tuple[np.ndarray, np.ndarray]]]:
    """(the modules other than MoE experts, each checked to have a GGUF target; the experts' merged,
    scaled (A, B) by target)."""
    expert_modules = {m: halves for m, halves in pairs.items() if is_expert_module(m)}
    pairs = {m: halves for m, halves in pairs.items() if m not in expert_modules}
    unsupported = sorted(m for m in pairs if gguf_target(m) is None)
    if unsupported:
        raise ConversionError(
            f"unsupported target modules: {', '.join(unsupported)} "
            "(supported: q/k/v/o_proj, gate/up/down_proj, embed_tokens, lm_head, an MoE router and its experts)"
        )
    try:
        experts = expert_pairs(expert_modules, hp, scale_of, alpha) if expert_modules else {}
    except ExpertConversionError as e:
        raise ConversionError(str(e)) from e
    return pairs, experts


def _open_writer(out_path: str | os.PathLike[str], arch: str, alpha: float, is_dora: bool, options: ConvertOptions,
                 invocation: tuple[int, ...] | None, chat_template: str | None) -> GGUFWriter:
    """A writer of the adapter file with its metadata set."""
    writer = GGUFWriter(str(out_path), arch)
    writer.add_string("general.type", "adapter")
    writer.add_string("adapter.type", "lora")
    writer.add_float32("adapter.lora.alpha", alpha)
    if is_dora:
        writer.add_bool(DORA_KEY, True)
    if options.task_name:
        writer.add_string("adapter.lora.task_name", options.task_name)
    if options.prompt_prefix:
        writer.add_string("adapter.lora.prompt_prefix", options.prompt_prefix)
    if invocation:
        writer.add_key_value(INVOCATION_KEY, list(invocation), GGUFValueType.ARRAY, sub_type=GGUFValueType.UINT32)
    if chat_template:
        writer.add_string(CHAT_TEMPLATE_KEY, chat_template)
    return writer


def _rope_heads(hp: ModelHParams, target: str) -> int | None:
    """The heads whose rows llama.cpp permutes for its adjacent-pair rope: q's or k's; None for any other target."""
    if hp.rope_style != RopeStyle.ADJACENT_PAIRS or not target.endswith((".attn_q.weight", ".attn_k.weight")):
        return None
    return hp.num_heads if ".attn_q." in target else hp.num_kv_heads


def _write_module(writer: GGUFWriter, module: str, halves: dict[str, StoredTensor], hp: ModelHParams,
                  fold_of: Callable[[str, int], float], outtype: str, is_dora: bool) -> str:
    """Write one module's A and B (B times `fold_of` it and its rank, rows permuted for the rope) and a DoRA's
    magnitudes, under the name of the base tensor it targets, which it returns."""
    target = gguf_target(module)
    is_embedding = target == "token_embd.weight"
    a_key, b_key = ("lora_embedding_A", "lora_embedding_B") if is_embedding else ("lora_A", "lora_B")
    if a_key not in halves or b_key not in halves:
        raise ConversionError(f"module {module} lacks {a_key} or {b_key}")
    a, b = halves[a_key], halves[b_key]
    scale = fold_of(module, a.data.shape[0])
    is_rescaled = not math.isclose(scale, 1.0, rel_tol=1e-6)
    b_values = b.to_float32() * scale if is_rescaled else None
    heads = _rope_heads(hp, target)
    if heads is not None:
        b_values = permute_rows_for_adjacent_rope(b.to_float32() if b_values is None else b_values, heads)
    if is_embedding:  # A is stored [V, r] for ggml's get_rows
        a = StoredTensor(a.dtype, np.ascontiguousarray(a.data.T))
    _write_tensor(writer, f"{target}.lora_a", a, None, outtype)
    _write_tensor(writer, f"{target}.lora_b", b, b_values, outtype, is_rescaled)
    if is_dora:  # one value per output channel: permuted as B's rows; F32 whatever the outtype (it is small)
        m = halves["lora_magnitude_vector"].to_float32().reshape(-1)
        if heads is not None:
            m = permute_rows_for_adjacent_rope(m, heads)
        writer.add_tensor(f"{target}{MAGNITUDE_SUFFIX}", np.ascontiguousarray(m, dtype=np.float32))
    return target


def _check_dora(pairs: dict[str, dict[str, StoredTensor]], is_dora: bool) -> None:
    """A DoRA adapter has a magnitude on every linear module and none elsewhere; a LoRA has none."""
    for module, halves in sorted(pairs.items()):
        has_magnitude = "lora_magnitude_vector" in halves
        if has_magnitude and not is_dora:
            raise ConversionError(f"module {module} has a lora_magnitude_vector but adapter_config.json does not set use_dora")
        if not is_dora:
            continue
        if "lora_embedding_A" in halves or is_expert_module(module) or gguf_target(module) == "token_embd.weight":
            raise ConversionError(f"DoRA on {module} is not supported (only linear modules)")
        if not has_magnitude:
            raise ConversionError(f"module {module} lacks its lora_magnitude_vector (use_dora is set)")
        if "lora_B" in halves and halves["lora_magnitude_vector"].data.size != halves["lora_B"].data.shape[0]:
            raise ConversionError(f"module {module}: lora_magnitude_vector has {halves['lora_magnitude_vector'].data.size} values, "
                                  f"lora_B has {halves['lora_B'].data.shape[0]} rows")


def _invocation_tokens(options: ConvertOptions, config: dict, base: GGUFFile) -> tuple[int, ...] | None:
    if options.invocation_tokens is not None and options.invocation_string is not None:
        raise ConversionError("give either invocation tokens or an invocation string, not both")
    if options.invocation_tokens is not None:
        return tuple(options.invocation_tokens)
    if options.invocation_string is not None:
        tokens = GGUFTokenizer(base).encode(options.invocation_string, add_special=False, parse_special=True)
        if not tokens:
            raise ConversionError("the invocation string tokenizes to nothing")
        return tuple(tokens)
    from_config = config.get("alora_invocation_tokens")
    return tuple(int(t) for t in from_config) if from_config else None
