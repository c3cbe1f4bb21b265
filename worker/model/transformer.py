"""Decoder-only transformer for llama (Mixtral too), qwen2, qwen3, qwen3moe, gemma3 and phi3 GGUF models.

Modules are named after GGUF tensors (`blk.3.attn_q` holds `blk.3.attn_q.weight`)
so weights and adapters map by name. Knows nothing of LoRA: adapters wrap the
linear layers from outside (worker/lora/).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from worker.formats.hparams import ModelHParams, RopeStyle
from worker.model.attention import AttentionPlan, KVCache, attention
from worker.model.moe import ExpertLinear, moe_ffn

ACTIVATIONS = {"silu": F.silu, "gelu_tanh": lambda x: F.gelu(x, approximate="tanh")}


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x.float(), self.weight.shape, self.weight.float(), self.eps).to(x.dtype)


class Rotary(nn.Module):
    """RoPE tables for every position up to the context length."""

    def __init__(
        self, hp: ModelHParams, freq_factors: torch.Tensor | None = None, base: float | None = None, freq_scale: float | None = None
    ) -> None:
        super().__init__()
        self.style = hp.rope_style
        self.rope_dim = hp.rope_dim
        base = hp.rope_base if base is None else base
        freq_scale = hp.rope_freq_scale if freq_scale is None else freq_scale
        exponents = torch.arange(0, hp.rope_dim, 2, dtype=torch.float64) / hp.rope_dim
        inv_freq = freq_scale / (base**exponents)  # [rope_dim/2]
        if freq_factors is not None:
            inv_freq = inv_freq / freq_factors.to(inv_freq.device, torch.float64)
        angles = torch.outer(torch.arange(hp.context_length, dtype=torch.float64), inv_freq)
        if self.style == RopeStyle.ADJACENT_PAIRS:  # [ctx, rope_dim/2] complex: cos + i sin
            self.register_buffer("turns", torch.polar(torch.ones_like(angles), angles).to(torch.complex64), persistent=False)
        else:  # [ctx, rope_dim/2] each
            self.register_buffer("cos", angles.cos().float(), persistent=False)
            self.register_buffer("sin", angles.sin().float(), persistent=False)

    def tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Per forward pass, shared by every layer: rotations for positions [N]."""
        if self.style == RopeStyle.ADJACENT_PAIRS:
            return (self.turns[positions].unsqueeze(1),)  # [N, 1, rope_dim/2] complex
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)

    def forward(self, x: torch.Tensor, tables: tuple[torch.Tensor, ...]) -> torch.Tensor:
        # x: [N, H, D]
        rot = x[..., : self.rope_dim].float()
        if self.style == RopeStyle.ADJACENT_PAIRS:  # (x0, x1) pairs as complex numbers, turned
            rotated = torch.view_as_real(torch.view_as_complex(rot.unflatten(-1, (-1, 2)).contiguous()) * tables[0]).flatten(-2)
        else:
            cos, sin = tables
            x0, x1 = rot.chunk(2, dim=-1)
            rotated = torch.cat((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1)
        if self.rope_dim == x.shape[-1]:
            return rotated.to(x.dtype)
        return torch.cat((rotated.to(x.dtype), x[..., self.rope_dim :]), dim=-1)


class Block(nn.Module):
    def __init__(self, hp: ModelHParams, index: int) -> None:
        super().__init__()
        self.index = index
        self.num_heads, self.num_kv_heads, self.head_dim = hp.num_heads, hp.num_kv_heads, hp.head_dim
        q_dim, kv_dim = hp.num_heads * hp.head_dim, hp.num_kv_heads * hp.head_dim
        self.attn_norm = RMSNorm(hp.embed_dim, hp.rms_norm_eps)
        self.qkv_split = (q_dim, kv_dim, kv_dim) if hp.has_fused_qkv else None
        if hp.has_fused_qkv:  # phi3: one matrix, rows q then k then v
            self.attn_qkv = nn.Linear(hp.embed_dim, q_dim + 2 * kv_dim, bias=hp.has_qkv_bias)
        else:
            self.attn_q = nn.Linear(hp.embed_dim, q_dim, bias=hp.has_qkv_bias)
            self.attn_k = nn.Linear(hp.embed_dim, kv_dim, bias=hp.has_qkv_bias)
            self.attn_v = nn.Linear(hp.embed_dim, kv_dim, bias=hp.has_qkv_bias)
        self.attn_output = nn.Linear(q_dim, hp.embed_dim, bias=False)
        if hp.has_qk_norm:  # per head, over head_dim (qwen3, gemma3)
            self.attn_q_norm = RMSNorm(hp.head_dim, hp.rms_norm_eps)
            self.attn_k_norm = RMSNorm(hp.head_dim, hp.rms_norm_eps)
        if hp.has_post_norms:  # of each sublayer's output, before its residual add (gemma3)
            self.post_attention_norm = RMSNorm(hp.embed_dim, hp.rms_norm_eps)
            self.post_ffw_norm = RMSNorm(hp.embed_dim, hp.rms_norm_eps)
        self.has_qk_norm, self.has_post_norms = hp.has_qk_norm, hp.has_post_norms
        self.is_swa = hp.is_swa(index)
        self.attention_scale = hp.attention_scale
        self.activation = ACTIVATIONS[hp.ffn_activation]
        self.ffn_norm = RMSNorm(hp.embed_dim, hp.rms_norm_eps)
        self.num_experts_used = hp.expert_used_count
        if hp.is_moe:  # the router and the experts (worker/model/moe.py)
            self.ffn_gate_inp = nn.Linear(hp.embed_dim, hp.expert_count, bias=False)
            self.ffn_gate_exps = ExpertLinear(hp.expert_count, hp.embed_dim, hp.expert_ffn_dim)
            self.ffn_up_exps = ExpertLinear(hp.expert_count, hp.embed_dim, hp.expert_ffn_dim)
            self.ffn_down_exps = ExpertLinear(hp.expert_count, hp.expert_ffn_dim, hp.embed_dim)
        elif hp.has_fused_gate_up:  # phi3: ffn_up holds the gate's rows, then the up projection's
            self.ffn_up = nn.Linear(hp.embed_dim, 2 * hp.ffn_dim, bias=False)
            self.ffn_down = nn.Linear(hp.ffn_dim, hp.embed_dim, bias=False)
        else:
            self.ffn_gate = nn.Linear(hp.embed_dim, hp.ffn_dim, bias=False)
            self.ffn_up = nn.Linear(hp.embed_dim, hp.ffn_dim, bias=False)
            self.ffn_down = nn.Linear(hp.ffn_dim, hp.embed_dim, bias=False)
        self.has_fused_gate_up = hp.has_fused_gate_up

    def forward(
        self,
        x: torch.Tensor,
        rope_tables: tuple[torch.Tensor, ...],
        rope: Rotary,
        cache: KVCache,
        plan: AttentionPlan,
        keep: RowSelection | None = None,
    ) -> torch.Tensor:
        # x: [N, d] new tokens of every sequence in the batch -> [N, d], or [len(keep.rows), d]
        num_tokens = x.shape[0]
        h = self.attn_norm(x)
        if self.qkv_split is not None:
            q, k, v = self.attn_qkv(h).split(self.qkv_split, dim=-1)
        else:
            q, k, v = self.attn_q(h), self.attn_k(h), self.attn_v(h)
        q = q.reshape(num_tokens, self.num_heads, self.head_dim)
        k = k.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        if self.has_qk_norm:
            q, k = self.attn_q_norm(q), self.attn_k_norm(k)
        q, k = rope(q, rope_tables), rope(k, rope_tables)
        o = attention(self.index, q, k, v, cache, plan, self.is_swa, self.attention_scale)  # every row's K and V are in the cache now
        if keep is not None:  # the rest only for the rows whose output is wanted
            if keep.rows.numel() == 0:
                return x[:0]
            o, x = o.index_select(0, keep.rows), x.index_select(0, keep.rows)
            keep.on_select(keep.rows)
        a = self.attn_output(o)
        x = x + (self.post_attention_norm(a) if self.has_post_norms else a)
        h = self.ffn_norm(x)
        if self.num_experts_used:
            f = moe_ffn(h, self, self.num_experts_used, self.activation)
        elif self.has_fused_gate_up:
            gate, up = self.ffn_up(h).chunk(2, dim=-1)
            f = self.ffn_down(self.activation(gate) * up)
        else:
            f = self.ffn_down(self.activation(self.ffn_gate(h)) * self.ffn_up(h))
        return x + (self.post_ffw_norm(f) if self.has_post_norms else f)


@dataclass(frozen=True)
class RowSelection:
    """The rows of a pass whose final hidden states are wanted (llama.cpp's output ids): the
    last layer computes its attention for every row, since each row's K and V go to the
    cache, and the rest of the layer only for these. `on_select(rows)` runs first, for
    whatever the caller keeps per row (the pass's adapter scales)."""

    rows: torch.Tensor  # [M] indices into the pass's rows
    on_select: Callable[[torch.Tensor], None] = lambda rows: None


class Transformer(nn.Module):
    def __init__(self, hp: ModelHParams) -> None:
        super().__init__()
        self.hp = hp
        self.token_embd = nn.Embedding(hp.vocab_size, hp.embed_dim)
        self.blk = nn.ModuleList(Block(hp, i) for i in range(hp.num_layers))
        self.output_norm = RMSNorm(hp.embed_dim, hp.rms_norm_eps)
        self.output = nn.Linear(hp.embed_dim, hp.vocab_size, bias=False)
        self.rope = Rotary(hp)
        self.rope_swa = Rotary(hp, base=hp.rope_base_swa, freq_scale=1.0) if hp.rope_base_swa is not None else None

    def tie_output(self) -> None:
        """Use the token embedding as output projection (GGUF without output.weight)."""
        self.output.weight = self.token_embd.weight

    def forward(self, input_ids: torch.Tensor, cache: KVCache, plan: AttentionPlan, keep: RowSelection | None = None) -> torch.Tensor:
        """input_ids [N] (flattened over sequences, see AttentionPlan) -> final hidden states [N, embed_dim],
        or only those of `keep.rows` [M, embed_dim]: a prompt's rows but its last need only their K and V
        from the last layer, which then skips its output projection and FFN for them."""
        x = self.token_embd(input_ids)
        if self.hp.embedding_scale != 1.0:
            x = x * self.hp.embedding_scale
        rope_tables = self.rope.tables(plan.positions)
        swa_tables = self.rope_swa.tables(plan.positions) if self.rope_swa is not None else None
        last = len(self.blk) - 1
        for i, block in enumerate(self.blk):
            if block.is_swa and self.rope_swa is not None:  # the windowed layers' own RoPE base
                x = block(x, swa_tables, self.rope_swa, cache, plan, keep if i == last else None)
            else:
                x = block(x, rope_tables, self.rope, cache, plan, keep if i == last else None)
        return self.output_norm(x)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.output(hidden).float()
