"""KV sequence slots and attention over a flattened batch of sequences.

The cache is a slab of `num_seq_slots` sequence slots, each `slot_len` tokens
long (llama.cpp's server splits its context the same way). A step's tokens are
flattened: token `i` belongs to sequence slot `seq_slots[i]` at position
`positions[i]`. Sequences with one new token (decoding) share one batched
attention over the slot range they span; a sequence with several new tokens
(prefill) attends on its own with a causal mask. A speculative span (the last
token and its drafts, `Segment.is_verify`) attends as decoding does instead: its
d-th row joins the d-th batched decode, so each verified position gets the
arithmetic of decoding it alone (torch's fused kernel), not the chunk path's
matmuls and softmax.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class KVCache:
    """Preallocated keys and values: [num_layers, num_seq_slots, num_kv_heads, slot_len, head_dim]."""

    k: torch.Tensor
    v: torch.Tensor

    @classmethod
    def allocate(
        cls, num_layers: int, num_seq_slots: int, num_kv_heads: int, slot_len: int, head_dim: int, dtype: torch.dtype, device: torch.device
    ) -> KVCache:
        shape = (num_layers, num_seq_slots, num_kv_heads, slot_len, head_dim)
        return cls(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))

    @property
    def num_seq_slots(self) -> int:
        return self.k.shape[1]

    @property
    def slot_len(self) -> int:
        return self.k.shape[3]

    @property
    def num_bytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()

    def copy_prefix(self, src_slot: int, dst_slot: int, length: int) -> None:
        """Positions 0..length of one sequence slot into another (on the device, every layer at once)."""
        self.k[:, dst_slot, :, :length].copy_(self.k[:, src_slot, :, :length])
        self.v[:, dst_slot, :, :length].copy_(self.v[:, src_slot, :, :length])


@dataclass(frozen=True)
class Segment:
    """New tokens [row, row + length) of the flattened batch: one sequence's positions start..

    `is_verify`: every row attends as a decoding row does (a speculative span: the last token
    and its drafts), so each verified position's arithmetic is that of decoding it alone."""

    seq_slot: int
    row: int
    length: int
    start: int
    is_verify: bool = False


@dataclass
class DecodeGroup:
    """Rows that attend as one batched decode, at most one per sequence slot: they span
    sequence slots [first_slot, first_slot + span), row i at slot first_slot + index[i]."""

    rows: torch.Tensor  # [Bd]
    first_slot: int
    index: torch.Tensor  # [Bd] seq_slot - first_slot
    mask: torch.Tensor  # [span, 1, 1, kv_len] True where a key is visible
    mask_swa: torch.Tensor | None  # the same for sliding-window layers: only the last `window` positions
    is_all_span: bool  # every slot in the span decodes, in row order

    @classmethod
    def build(cls, decodes: Sequence[Segment], device: torch.device, window: int | None) -> DecodeGroup:
        first = min(s.seq_slot for s in decodes)
        span = max(s.seq_slot for s in decodes) - first + 1
        kv_len = max(s.start for s in decodes) + 1
        visible = torch.zeros(span, kv_len, dtype=torch.bool)
        visible[:, 0] = True  # slots in the span that do not decode: harmless, discarded rows
        for s in decodes:
            visible[s.seq_slot - first, : s.start + 1] = True
        index = [s.seq_slot - first for s in decodes]
        mask_swa = None
        if window is not None:  # keys within the window: position > start - window
            recent = torch.arange(kv_len)[None, :] > torch.tensor([[s.start - window] for s in _in_span_order(decodes, first, span)])
            mask_swa = (visible & recent).view(span, 1, 1, kv_len).to(device)
        return cls(
            torch.tensor([s.row for s in decodes], dtype=torch.long, device=device), first,
            torch.tensor(index, dtype=torch.long, device=device), visible.view(span, 1, 1, kv_len).to(device), mask_swa,
            index == list(range(span)),
        )


@dataclass
class AttentionPlan:
    """Host-built indices for one forward pass (tensors on the compute device)."""

    seq_slots: torch.Tensor  # [N] sequence slot of each new token
    positions: torch.Tensor  # [N] its position in the sequence
    chunks: list[Segment]  # sequences with several new tokens: attend one by one
    decodes: list[DecodeGroup]  # single-token rows: group d holds each decoding sequence's d-th row (several for a verify span)
    is_decode_only: bool  # one group, every slot of its span, and nothing else runs: rows are the span's slots in order
    window: int | None = None  # the sliding window of the model's windowed layers

    @classmethod
    def build(cls, segments: Sequence[Segment], device: torch.device, window: int | None = None) -> AttentionPlan:
        seq_slots, positions = [], []
        for seg in segments:
            seq_slots += [seg.seq_slot] * seg.length
            positions += range(seg.start, seg.start + seg.length)
        chunks = [s for s in segments if s.length > 1 and not s.is_verify]
        depths: list[list[Segment]] = []  # a verify span's d-th row joins the d-th group
        for s in segments:
            if s.length == 1 or s.is_verify:
                for d in range(s.length):
                    if d == len(depths):
                        depths.append([])
                    depths[d].append(s if s.length == 1 else Segment(s.seq_slot, s.row + d, 1, s.start + d))
        decodes = [DecodeGroup.build(group, device, window) for group in depths]
        is_decode_only = (len(decodes) == 1 and decodes[0].is_all_span and not chunks
                          and [s.row for s in depths[0]] == list(range(len(depths[0]))))
        return cls(
            torch.tensor(seq_slots, dtype=torch.long, device=device),
            torch.tensor(positions, dtype=torch.long, device=device),
            chunks, decodes, is_decode_only, window,
        )


def _in_span_order(decodes: Sequence[Segment], first: int, span: int) -> list[Segment]:
    """One segment per slot of the span (slots that do not decode get a stand-in at position 0)."""
    by_slot = {s.seq_slot - first: s for s in decodes}
    return [by_slot.get(i, Segment(first + i, 0, 1, 0)) for i in range(span)]


QUERY_BLOCK = 128  # prompt positions whose scores are computed at once: [G*128, S] stays in cache


def _attend_block(q: torch.Tensor, k_layer: torch.Tensor, v_layer: torch.Tensor, out: torch.Tensor, seg: Segment, begin: int, end: int,
                  window: int | None, scale: float | None) -> None:
    """Positions [begin, end) of a prompt chunk attend to the slot's keys [0, end), written to `out`.

    Plain matmuls and a softmax per row, not torch's fused kernel: each position's arithmetic
    is then the same however the prompt was cut into chunks (a prefix loaded from the cache
    gives the logits computing it would have), and in blocks of QUERY_BLOCK positions the
    scores never leave the cache (a 1,024-token prompt's attention was 3.5x slower in one block).
    """
    n, num_heads, head_dim = end - begin, q.shape[1], q.shape[2]
    num_kv_heads = k_layer.shape[1]
    group = num_heads // num_kv_heads
    rows = slice(seg.row + begin - seg.start, seg.row + end - seg.start)
    qs = q[rows].view(n, num_kv_heads, group, head_dim).permute(1, 2, 0, 3).reshape(1, num_kv_heads, group * n, head_dim)
    key_pos = torch.arange(end, device=q.device)
    query_pos = torch.arange(begin, end, device=q.device).repeat(group)
    visible = key_pos[None, :] <= query_pos[:, None]  # [G*n, S], heads major
    if window is not None:
        visible &= key_pos[None, :] > query_pos[:, None] - window
    keys, values = k_layer[seg.seq_slot : seg.seq_slot + 1, :, :end], v_layer[seg.seq_slot : seg.seq_slot + 1, :, :end]
    scores = torch.matmul(qs * (head_dim**-0.5 if scale is None else scale), keys.transpose(-1, -2))  # scaled first: no fp16 overflow
    scores.masked_fill_(~visible, float("-inf"))
    o = torch.matmul(torch.softmax(scores, dim=-1, dtype=torch.float32).to(values.dtype), values)
    out[rows] = o.view(num_kv_heads, group, n, head_dim).permute(2, 0, 1, 3).reshape(n, num_heads, head_dim)


def attention(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: KVCache, plan: AttentionPlan,
              is_swa: bool = False, scale: float | None = None) -> torch.Tensor:
    """q [N, H, D], k/v [N, Hkv, D] for the new tokens -> attention output [N, H*D].

    Writes the new keys and values into their slots first. A sliding-window layer (`is_swa`)
    sees only the last `plan.window` positions; every position's K and V stay in the slot
    (a cached prefix is the same whatever the window). `scale` multiplies q.k (default 1/sqrt(D)).
    """
    num_tokens, num_heads, head_dim = q.shape
    k_layer, v_layer = cache.k[layer], cache.v[layer]  # [slots, Hkv, S, D]
    k_layer.transpose(1, 2)[plan.seq_slots, plan.positions] = k.to(k_layer.dtype)
    v_layer.transpose(1, 2)[plan.seq_slots, plan.positions] = v.to(v_layer.dtype)
    out = q.new_empty(num_tokens, num_heads, head_dim)
    for seg in plan.chunks:
        for begin in range(seg.start, seg.start + seg.length, QUERY_BLOCK):
            _attend_block(
                q, k_layer, v_layer, out, seg, begin, min(begin + QUERY_BLOCK, seg.start + seg.length),
                plan.window if is_swa else None, scale,
            )
    for group in plan.decodes:
        o = _attend_decodes(q, k_layer, v_layer, group, plan.is_decode_only, is_swa, scale)
        if plan.is_decode_only:
            return o.reshape(num_tokens, num_heads * head_dim)
        out.index_copy_(0, group.rows, o)
    return out.view(num_tokens, num_heads * head_dim)


def _attend_decodes(q: torch.Tensor, k_layer: torch.Tensor, v_layer: torch.Tensor, group: DecodeGroup, is_decode_only: bool,
                    is_swa: bool, scale: float | None) -> torch.Tensor:
    """One batched decode: each of the group's rows attends to its slot's keys -> [Bd, H, D]."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    span, kv_len = group.mask.shape[0], group.mask.shape[-1]
    first = group.first_slot
    qd = q if is_decode_only else q.index_select(0, group.rows)
    if not group.is_all_span:
        qd = qd.new_zeros(span, num_heads, head_dim).index_copy_(0, group.index, qd)
    keys, values = k_layer[first : first + span, :, :kv_len], v_layer[first : first + span, :, :kv_len]
    mask = group.mask_swa if is_swa else group.mask
    o = F.scaled_dot_product_attention(qd.unsqueeze(2), keys, values, attn_mask=mask, enable_gqa=True, scale=scale)
    o = o.view(span, num_heads, head_dim)
    return o if group.is_all_span else o.index_select(0, group.index)
