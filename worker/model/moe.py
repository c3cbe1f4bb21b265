"""Mixture-of-experts FFN as llama.cpp computes it for llama (Mixtral) and qwen3moe
(`build_moe_ffn` in src/llama-graph.cpp): the router's logits (`ffn_gate_inp`), their
softmax, the top `expert_used_count` experts per token, their probabilities
renormalised to sum to one, and the experts' SiLU-gated FFNs weighted by them.

Experts are stored as GGUF stores them, one 3-D tensor per projection
(`ffn_{gate,up,down}_exps`, ne = [in, out, n_expert], here [n_expert, out, in]).
A pass groups its (token, expert) pairs by expert, so each expert runs one matmul
over the rows routed to it (what ggml's `mul_mat_id` does); finding the groups
costs one device-to-host copy of the per-expert counts per MoE layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

# llama.cpp clamps the sum of the chosen probabilities to float16's smallest normal before dividing by it
MIN_WEIGHT_SUM = 6.103515625e-5


@dataclass
class Routes:
    """One pass's routing, shared by the three expert projections of a layer. Pairs
    (token, chosen expert) are ordered by expert, so each expert's rows are contiguous."""

    token: torch.Tensor  # [P] the token of each pair
    expert: torch.Tensor  # [P] the expert of each pair (non-decreasing)
    weight: torch.Tensor  # [P] its routing weight
    segments: list[tuple[int, int, int]]  # (expert, first pair, end) of every expert with pairs, on the host

    @classmethod
    def top_k(cls, logits: torch.Tensor, k: int) -> Routes:
        probs = torch.softmax(logits.float(), dim=-1)  # [N, E]
        weights, experts = probs.topk(k, dim=-1)  # [N, k] each
        weights = weights / weights.sum(dim=-1, keepdim=True).clamp_min(MIN_WEIGHT_SUM)
        flat = experts.reshape(-1)
        expert, order = flat.sort(stable=True)
        segments, start = [], 0
        for e, count in enumerate(torch.bincount(flat, minlength=logits.shape[-1]).tolist()):  # the layer's one host sync
            if count:
                segments.append((e, start, start + count))
                start += count
        return cls(order // k, expert, weights.reshape(-1)[order], segments)


class ExpertLinear(nn.Module):
    """`n_expert` linears without bias; `forward` maps each pair's row through its expert."""

    is_expert_linear = True  # what LoRA wraps (worker/model/quant.py's fp16 form has it too)

    def __init__(self, num_experts: int, in_features: int, out_features: int) -> None:
        super().__init__()
        self.num_experts, self.in_features, self.out_features = num_experts, in_features, out_features
        self.weight = nn.Parameter(torch.empty(num_experts, out_features, in_features))

    def forward(self, x: torch.Tensor, routes: Routes) -> torch.Tensor:
        # x: [P, in], rows in `routes` order -> [P, out]
        out = x.new_empty(x.shape[0], self.out_features)
        for e, start, end in routes.segments:
            torch.mm(x[start:end], self.weight[e].t(), out=out[start:end])
        return out


def moe_ffn(h: torch.Tensor, block: nn.Module, num_used: int, activation) -> torch.Tensor:
    """h [N, d] (normed) through `block`'s ffn_gate_inp and ffn_{gate,up,down}_exps -> [N, d]."""
    routes = Routes.top_k(block.ffn_gate_inp(h), num_used)
    rows = h.index_select(0, routes.token)  # [P, d]
    act = activation(block.ffn_gate_exps(rows, routes)) * block.ffn_up_exps(rows, routes)
    down = block.ffn_down_exps(act, routes).float() * routes.weight.unsqueeze(1)  # weighted and summed in fp32, as ggml
    return torch.zeros(h.shape, dtype=torch.float32, device=h.device).index_add_(0, routes.token, down).to(h.dtype)
