"""Tiny random models and adapters written as GGUF in tmp_path (seconds, no downloads).

Base models start as Hugging Face transformers models (the reference we compare
against) and are written the way llama.cpp's converter writes them: llama q/k
rows permuted for ggml's adjacent-pair rope, qwen2 untouched.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFValueType, GGUFWriter
from gguf.quants import quantize

from worker.formats.peft_convert import gguf_target, permute_rows_for_adjacent_rope

CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
USER_DEFINED = ["<tool>"]
MERGES = ["Ġ t", "l l", "e ll", "h ell", "hell o", "h e", "Ġt he", "i n", "Ġ a", "e r", "o n", "Ġ s"]


def _bytes_to_unicode() -> list[str]:
    keep = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return [table[b] for b in range(256)]


def tiny_vocab() -> tuple[list[str], list[int], list[str]]:
    """(tokens, token types, merges): special tokens first, then 256 bytes, then merges."""
    tokens = SPECIAL + _bytes_to_unicode() + ["".join(m.split(" ")) for m in MERGES] + USER_DEFINED
    types = [3] * len(SPECIAL) + [1] * (len(tokens) - len(SPECIAL) - len(USER_DEFINED)) + [4] * len(USER_DEFINED)
    return tokens, types, MERGES


@dataclass
class TinySpec:
    arch: str = "llama"
    embed_dim: int = 64
    ffn_dim: int = 128
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    context_length: int = 128
    rope_base: float = 10000.0
    rms_eps: float = 1e-5
    tied: bool = False
    seed: int = 0
    chat_template: str = CHATML
    init_std: float = 0.2
    sliding_window: int = 8  # gemma3
    num_experts: int = 0  # > 0: MoE (llama: Mixtral; qwen3moe needs it); ffn_dim is then each expert's width
    num_experts_used: int = 2
    weight_type: GGMLQuantizationType = GGMLQuantizationType.F32
    extra_metadata: dict = field(default_factory=dict)

    @property
    def vocab_size(self) -> int:
        return len(tiny_vocab()[0])


def hf_model(spec: TinySpec) -> torch.nn.Module:
    import transformers

    family = "mixtral" if spec.arch == "llama" and spec.num_experts else spec.arch
    config_cls, model_cls = {"llama": ("LlamaConfig", "LlamaForCausalLM"), "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
                             "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"), "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM"),
                             "mixtral": ("MixtralConfig", "MixtralForCausalLM"), "qwen3moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
                             "phi3": ("Phi3Config", "Phi3ForCausalLM")}[family]
    head_dim = spec.embed_dim // spec.num_heads
    extra: dict = {}
    if spec.arch == "qwen3":
        extra = {"head_dim": head_dim, "attention_bias": False}
    elif spec.arch == "qwen3moe":
        extra = {"head_dim": head_dim, "attention_bias": False,
                 "num_experts": spec.num_experts, "num_experts_per_tok": spec.num_experts_used,
                 "moe_intermediate_size": spec.ffn_dim, "norm_topk_prob": True}  # llama.cpp always renormalises the top-k
    elif spec.arch == "phi3":  # its defaults name token ids past the tiny vocabulary
        extra = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
    elif family == "mixtral":
        extra = {"num_local_experts": spec.num_experts, "num_experts_per_tok": spec.num_experts_used}
    elif spec.arch == "gemma3":  # q scaled by 1/sqrt(head_dim), as llama.cpp does below 27B
        extra = {"head_dim": head_dim, "sliding_window": spec.sliding_window, "query_pre_attn_scalar": head_dim}
    config = getattr(transformers, config_cls)(
        vocab_size=spec.vocab_size, hidden_size=spec.embed_dim, intermediate_size=spec.ffn_dim,
        num_hidden_layers=spec.num_layers, num_attention_heads=spec.num_heads, num_key_value_heads=spec.num_kv_heads,
        max_position_embeddings=spec.context_length, rms_norm_eps=spec.rms_eps, rope_theta=spec.rope_base,
        tie_word_embeddings=spec.tied, initializer_range=spec.init_std, **extra,
    )
    model_cls = getattr(transformers, model_cls)
    torch.manual_seed(spec.seed)
    model = model_cls(config).eval()
    with torch.no_grad():  # norms and biases away from their trivial init
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.2 * torch.randn_like(p))
            elif name.endswith(".bias"):
                p.copy_(0.2 * torch.randn_like(p))
    return model


_GEMMA3_NORMS = {
    "input_layernorm": "blk.{layer}.attn_norm.weight", "post_attention_layernorm": "blk.{layer}.post_attention_norm.weight",
    "pre_feedforward_layernorm": "blk.{layer}.ffn_norm.weight", "post_feedforward_layernorm": "blk.{layer}.post_ffw_norm.weight",
    "q_norm": "blk.{layer}.attn_q_norm.weight", "k_norm": "blk.{layer}.attn_k_norm.weight", "norm": "output_norm.weight",
}


def gguf_tensors_from_hf(spec: TinySpec, state: dict[str, torch.Tensor]) -> dict[str, np.ndarray]:
    """HF state dict -> GGUF tensor names and layouts (numpy axes, as GGUFWriter takes them)."""
    out = {}
    head_dim = spec.embed_dim // spec.num_heads
    for key, tensor in state.items():
        array = tensor.detach().float().numpy().copy()
        module, _, kind = key.rpartition(".")
        if spec.arch == "gemma3" and module.endswith("norm"):  # Gemma's norms scale by 1 + w; llama.cpp's converter adds the 1
            out[_GEMMA3_NORMS[module.rpartition(".")[2]].format(layer=module.split(".")[2] if ".layers." in module else "")] = array + 1
            continue
        if module == "model.norm":
            out["output_norm.weight"] = array
            continue
        if module.endswith("input_layernorm") or module.endswith("post_attention_layernorm"):
            layer = module.split(".")[2]
            out[f"blk.{layer}.{'attn_norm' if 'input' in module else 'ffn_norm'}.weight"] = array
            continue
        if module.endswith(("self_attn.q_norm", "self_attn.k_norm")):  # qwen3
            out[f"blk.{module.split('.')[2]}.attn_{module[-6]}_norm.weight"] = array
            continue
        if spec.tied and module == "lm_head":
            continue
        if module.endswith(".mlp.experts"):  # transformers keeps experts fused: gate_up [E, 2ff, d], down [E, d, ff]
            layer = module.split(".")[2]
            if kind == "gate_up_proj":
                gate, up = np.split(array, 2, axis=1)
                out[f"blk.{layer}.ffn_gate_exps.weight"], out[f"blk.{layer}.ffn_up_exps.weight"] = gate.copy(), up.copy()
            else:
                out[f"blk.{layer}.ffn_down_exps.weight"] = array
            continue
        target = gguf_target(module)
        assert target is not None, key
        name = target.removesuffix(".weight") + "." + kind
        if spec.arch == "llama" and (".attn_q." in name or ".attn_k." in name):
            array = permute_rows_for_adjacent_rope(array, spec.num_heads if ".attn_q." in name else spec.num_kv_heads)
        out[name] = array
    assert head_dim * spec.num_heads == spec.embed_dim
    return out


def write_base(path: Path, spec: TinySpec, tensors: dict[str, np.ndarray]) -> Path:
    arch = spec.arch
    w = GGUFWriter(str(path), arch)
    w.add_string("general.type", "model")
    w.add_string("general.name", f"tiny-{arch}")
    w.add_uint32(f"{arch}.context_length", spec.context_length)
    w.add_uint32(f"{arch}.embedding_length", spec.embed_dim)
    w.add_uint32(f"{arch}.feed_forward_length", spec.ffn_dim)
    w.add_uint32(f"{arch}.block_count", spec.num_layers)
    w.add_uint32(f"{arch}.attention.head_count", spec.num_heads)
    w.add_uint32(f"{arch}.attention.head_count_kv", spec.num_kv_heads)
    w.add_uint32(f"{arch}.rope.dimension_count", spec.embed_dim // spec.num_heads)
    w.add_float32(f"{arch}.rope.freq_base", spec.rope_base)
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", spec.rms_eps)
    tokens, types, merges = tiny_vocab()
    w.add_string("tokenizer.ggml.model", "gpt2")
    w.add_string("tokenizer.ggml.pre", "smollm" if arch == "llama" else "qwen2")
    if spec.num_experts:
        w.add_uint32(f"{arch}.expert_count", spec.num_experts)
        w.add_uint32(f"{arch}.expert_used_count", spec.num_experts_used)
    if arch == "qwen3moe":
        w.add_uint32(f"{arch}.expert_feed_forward_length", spec.ffn_dim)
    if arch in ("qwen3", "qwen3moe", "gemma3"):
        w.add_uint32(f"{arch}.attention.key_length", spec.embed_dim // spec.num_heads)
        w.add_uint32(f"{arch}.attention.value_length", spec.embed_dim // spec.num_heads)
    if arch == "gemma3":
        w.add_uint32(f"{arch}.attention.sliding_window", spec.sliding_window)
    w.add_array("tokenizer.ggml.tokens", tokens)
    w.add_key_value("tokenizer.ggml.token_type", types, GGUFValueType.ARRAY, sub_type=GGUFValueType.INT32)
    w.add_array("tokenizer.ggml.merges", merges)
    w.add_uint32("tokenizer.ggml.bos_token_id", 1)
    w.add_uint32("tokenizer.ggml.eos_token_id", 2)
    w.add_bool("tokenizer.ggml.add_bos_token", False)
    w.add_string("tokenizer.chat_template", spec.chat_template)
    for key, value in spec.extra_metadata.items():
        w.add_key_value(key, value[1], value[0])
    for name, array in tensors.items():
        is_matrix = array.ndim in (2, 3) and name != "rope_freqs.weight"  # 3-D: experts
        if is_matrix and spec.weight_type not in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
            w.add_tensor(name, quantize(array, spec.weight_type), raw_dtype=spec.weight_type)
        elif is_matrix and spec.weight_type == GGMLQuantizationType.F16:
            w.add_tensor(name, array.astype(np.float16))
        else:
            w.add_tensor(name, array.astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@dataclass
class TinyModel:
    spec: TinySpec
    path: Path
    hf: torch.nn.Module
    tensors: dict[str, np.ndarray]  # what was written, float32

    def with_tensors(self, path: Path, changes: dict[str, np.ndarray]) -> Path:
        """Write a copy of this base with some tensors replaced or added."""
        return write_base(path, self.spec, {**self.tensors, **changes})


def make_tiny_model(directory: Path, spec: TinySpec | None = None, name: str | None = None) -> TinyModel:
    spec = spec or TinySpec()
    hf = hf_model(spec)
    tensors = gguf_tensors_from_hf(spec, hf.state_dict())
    path = write_base(directory / (name or f"tiny-{spec.arch}{'-tied' if spec.tied else ''}.gguf"), spec, tensors)
    return TinyModel(spec, path, hf, tensors)


def random_lora(model: TinyModel, targets: list[str], rank: int, seed: int, std: float = 0.3) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """target -> (A, B) in the numpy layouts of docs/architecture.md#adapters-we-read: linear A (r, k), B (d, r);
    token_embd A (V, r), B (d, r); experts A (E, r, k), B (E, d, r)."""
    rng = np.random.default_rng(seed)
    out = {}
    for target in targets:
        *experts, d, k = model.tensors[target].shape  # numpy (out, in); token_embd is (V, d); experts (E, out, in)
        if experts:
            a, b = rng.normal(0, std, (*experts, rank, k)), rng.normal(0, std, (*experts, d, rank))
        elif target == "token_embd.weight":
            a, b = rng.normal(0, std, (d, rank)), rng.normal(0, std, (k, rank))
        else:
            a, b = rng.normal(0, std, (rank, k)), rng.normal(0, std, (d, rank))
        out[target] = (a.astype(np.float32), b.astype(np.float32))
    return out


def write_adapter(
    path: Path,
    pairs: dict[str, tuple[np.ndarray | None, np.ndarray | None]],
    *,
    arch: str = "llama",
    alpha: float | None = 8.0,
    metadata: dict[str, tuple[GGUFValueType, object, GGUFValueType | None]] | None = None,
    general_type: str | None = "adapter",
    adapter_type: str | None = "lora",
    tensor_type: GGMLQuantizationType = GGMLQuantizationType.F32,
    extra_tensors: dict[str, np.ndarray] | None = None,
) -> Path:
    """A llama.cpp-format adapter; None for a half leaves that tensor out."""
    w = GGUFWriter(str(path), arch)
    if general_type is not None:
        w.add_string("general.type", general_type)
    if adapter_type is not None:
        w.add_string("adapter.type", adapter_type)
    if alpha is not None:
        w.add_float32("adapter.lora.alpha", alpha)
    for key, (vtype, value, sub_type) in (metadata or {}).items():
        w.add_key_value(key, value, vtype, sub_type=sub_type)
    for target, (a, b) in pairs.items():
        for half, array in (("lora_a", a), ("lora_b", b)):
            if array is None:
                continue
            if tensor_type == GGMLQuantizationType.F16:
                w.add_tensor(f"{target}.{half}", array.astype(np.float16))
            elif tensor_type == GGMLQuantizationType.F32:
                w.add_tensor(f"{target}.{half}", array.astype(np.float32))
            else:
                w.add_tensor(f"{target}.{half}", quantize(array.astype(np.float32), tensor_type), raw_dtype=tensor_type)
    for name, array in (extra_tensors or {}).items():
        w.add_tensor(name, array)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def invocation_metadata(tokens: list[int]) -> dict:
    return {"adapter.alora.invocation_tokens": (GGUFValueType.ARRAY, tokens, GGUFValueType.UINT32)}
