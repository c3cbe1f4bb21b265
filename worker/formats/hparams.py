"""Model hyper-parameters read from GGUF metadata (torch-free)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum

from worker.formats.gguf_file import GGUFFile


class UnsupportedModelError(ValueError):
    """The GGUF describes a model this worker cannot run."""


class RopeStyle(Enum):
    # ggml's normal rope: rotates adjacent pairs (x[2i], x[2i+1]); GGUF llama q/k
    # rows are stored permuted for it by llama.cpp's HF converter.
    ADJACENT_PAIRS = "adjacent_pairs"
    # GPT-NeoX rope: rotates (x[i], x[i + n_rot/2]) (HF's rotate_half).
    NEOX = "neox"


ROPE_STYLE_BY_ARCH = {
    "llama": RopeStyle.ADJACENT_PAIRS,  # with expert_count > 0: Mixtral
    "qwen2": RopeStyle.NEOX,
    "qwen3": RopeStyle.NEOX,
    "qwen3moe": RopeStyle.NEOX,
    "gemma3": RopeStyle.NEOX,
    "phi3": RopeStyle.NEOX,  # fused attn_qkv and gate/up (ffn_up [d, 2 ff])
}
GEMMA3_SWA_PATTERN = 6  # llama.cpp: of every 6 layers, the first 5 attend within the window, the 6th to everything
GEMMA3_SWA_ROPE_BASE = 10000.0  # llama.cpp's rope base for gemma3's sliding-window layers (when the GGUF names none)


@dataclass(frozen=True)
class ModelHParams:
    arch: str
    name: str
    vocab_size: int
    context_length: int
    num_layers: int
    embed_dim: int
    ffn_dim: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_dim: int
    rope_style: RopeStyle
    rope_base: float
    rope_freq_scale: float  # linear rope scaling: positions are multiplied by this
    has_rope_freq_factors: bool  # llama 3.1 style per-frequency divisors (rope_freqs.weight)
    rms_norm_eps: float
    has_qkv_bias: bool
    has_qk_norm: bool  # qwen3: RMSNorm over each head of q and k before RoPE (attn_q_norm, attn_k_norm)
    is_output_tied: bool  # no output.weight: the output projection reuses token_embd
    # gemma3 (defaults: the llama family's)
    embedding_scale: float = 1.0  # token embeddings are multiplied by this (gemma3: sqrt(embed_dim))
    ffn_activation: str = "silu"  # of the gate: silu | gelu_tanh
    has_post_norms: bool = False  # RMSNorm of the attention and FFN outputs before their residual adds
    attention_scale: float | None = None  # of q.k; None: 1 / sqrt(head_dim)
    sliding_window: int | None = None  # keys a sliding-window layer sees: the last `sliding_window` positions
    swa_layers: tuple[bool, ...] = ()  # per layer: attends within the sliding window
    rope_base_swa: float | None = None  # the sliding-window layers' own RoPE base (their scaling is 1)
    # mixture of experts (llama with expert_count > 0, qwen3moe): every layer's FFN is routed
    expert_count: int = 0
    expert_used_count: int = 0  # experts each token goes to (top-k of the router's softmax)
    expert_ffn_dim: int = 0  # each expert's FFN width
    # phi3: q, k and v in one attn_qkv matrix; gate and up in one ffn_up of 2 * ffn_dim rows (gate first)
    has_fused_qkv: bool = False
    has_fused_gate_up: bool = False

    @property
    def is_moe(self) -> bool:
        return self.expert_count > 0

    def is_swa(self, layer: int) -> bool:
        return bool(self.swa_layers) and self.swa_layers[layer]

    @classmethod
    def from_gguf(cls, gguf: GGUFFile) -> ModelHParams:
        arch = gguf.get("general.architecture")
        if arch not in ROPE_STYLE_BY_ARCH:
            supported = ", ".join(sorted(ROPE_STYLE_BY_ARCH))
            raise UnsupportedModelError(f"{gguf.path}: architecture {arch!r} is not supported (supported: {supported})")
        if gguf.get("general.type", "model") != "model":
            raise UnsupportedModelError(f"{gguf.path}: general.type is {gguf.get('general.type')!r}, not a base model")

        def key(name: str, default: object = None) -> object:
            value = gguf.get(f"{arch}.{name}", default)
            if value is None:
                raise UnsupportedModelError(f"{gguf.path}: metadata key {arch}.{name} is missing")
            return value

        experts = _experts(gguf, arch, key)
        num_heads = int(key("attention.head_count"))
        num_kv_heads = int(key("attention.head_count_kv", num_heads))
        embed_dim = int(key("embedding_length"))
        head_dim = int(key("attention.key_length", embed_dim // num_heads))
        if int(key("attention.value_length", head_dim)) != head_dim:
            raise UnsupportedModelError(f"{gguf.path}: key and value head sizes differ")
        scaling_type = str(key("rope.scaling.type", "none"))
        if scaling_type not in ("none", "linear"):
            raise UnsupportedModelError(f"{gguf.path}: rope scaling type {scaling_type!r} is not supported")
        scaling_factor = float(key("rope.scaling.factor", 0.0))
        embd = gguf.tensors.get("token_embd.weight")
        if embd is None:
            raise UnsupportedModelError(f"{gguf.path}: tensor token_embd.weight is missing")
        gemma = _gemma3(gguf, arch, key, embed_dim, num_heads, head_dim, int(key("block_count"))) if arch == "gemma3" else {}
        if arch == "phi3" and ("rope_factors_long.weight" in gguf.tensors or "rope_factors_short.weight" in gguf.tensors):
            # llama.cpp picks the long or short factors by the context the server runs with; we run one context
            raise UnsupportedModelError(f"{gguf.path}: phi3 with long-context RoPE factors (rope_factors_long/short) is not supported")
        return cls(
            arch=arch,
            name=str(gguf.get("general.name", gguf.path.stem)),
            vocab_size=embd.ne(1),  # the embedding's rows; the tokenizer's list may be shorter (padding)
            context_length=int(key("context_length")),
            num_layers=int(key("block_count")),
            embed_dim=embed_dim,
            ffn_dim=int(key("feed_forward_length", 0 if experts else None)),
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            rope_dim=int(key("rope.dimension_count", head_dim)),
            rope_style=ROPE_STYLE_BY_ARCH[arch],
            rope_base=float(key("rope.freq_base", 10000.0)),
            rope_freq_scale=1.0 / scaling_factor if scaling_type == "linear" and scaling_factor > 0 else 1.0,
            has_rope_freq_factors="rope_freqs.weight" in gguf.tensors,
            rms_norm_eps=float(key("attention.layer_norm_rms_epsilon")),
            has_qkv_bias="blk.0.attn_q.bias" in gguf.tensors,
            has_qk_norm="blk.0.attn_q_norm.weight" in gguf.tensors,
            is_output_tied="output.weight" not in gguf.tensors,
            has_fused_qkv="blk.0.attn_qkv.weight" in gguf.tensors,
            has_fused_gate_up=arch == "phi3",
            **gemma,
            **experts,
        )


def _experts(gguf: GGUFFile, arch: str, key) -> dict:
    """The MoE hyper-parameters as llama.cpp reads them for llama and qwen3moe ({} for a dense model)."""
    count = int(key("expert_count", 0))
    if count == 0:
        if arch == "qwen3moe":
            raise UnsupportedModelError(f"{gguf.path}: qwen3moe needs {arch}.expert_count > 0")
        return {}
    used = key("expert_used_count", 0)
    if isinstance(used, list):  # per layer; llama and qwen3moe use one value
        if len(set(used)) != 1:
            raise UnsupportedModelError(f"{gguf.path}: a different {arch}.expert_used_count per layer is not supported")
        used = used[0]
    used = int(used)
    if not 0 < used <= count:
        raise UnsupportedModelError(f"{gguf.path}: {arch}.expert_used_count is {used}, not between 1 and expert_count ({count})")
    ffn = int(key("expert_feed_forward_length", 0)) if arch == "qwen3moe" else 0
    if ffn == 0:  # llama: the FFN width is the experts'; qwen3moe without the key: llama.cpp's n_ff / n_expert_used
        ffn = int(key("feed_forward_length")) // (used if arch == "qwen3moe" else 1)
    return {"expert_count": count, "expert_used_count": used, "expert_ffn_dim": ffn}


def _gemma3(gguf: GGUFFile, arch: str, key, embed_dim: int, num_heads: int, head_dim: int, num_layers: int) -> dict:
    """Gemma 3's hyper-parameters as llama.cpp derives them (src/llama-model.cpp, LLM_ARCH_GEMMA3)."""
    window = int(key("attention.sliding_window", 0))
    swa = tuple(window > 0 and i % GEMMA3_SWA_PATTERN < GEMMA3_SWA_PATTERN - 1 for i in range(num_layers))
    is_27b = num_layers == 62  # llama.cpp scales q by the model size's rule, not by query_pre_attn_scalar
    return {
        "embedding_scale": math.sqrt(embed_dim),
        "ffn_activation": "gelu_tanh",
        "has_post_norms": True,
        "attention_scale": 1.0 / math.sqrt(embed_dim / num_heads if is_27b else head_dim),
        "sliding_window": window or None,
        "swa_layers": swa if window else (),
        "rope_base_swa": float(gguf.get(f"{arch}.rope.freq_base_swa", GEMMA3_SWA_ROPE_BASE)) if window else None,
    }
