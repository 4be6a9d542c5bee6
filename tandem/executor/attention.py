"""Paged attention over a flattened batch, in plain PyTorch (runs on CPU and any device).

Metadata is in the form a paged kernel takes (slot_mapping, block_tables, seq_lens,
query_start_loc); the gather indices and masks derived from it are built once per step and
shared by every layer. The batch is ordered decodes first: all single-token queries run as
one padded SDPA call; each multi-token (prefill) query runs its own causal SDPA call.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(slots=True)
class PrefillSpan:
    q_start: int
    q_end: int
    context_slots: torch.Tensor  # [seq_len] cache slots of the whole context, new tokens included
    mask: torch.Tensor | None  # [q_len, seq_len] bool; None: plain causal (no earlier context)


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] where each new token's K/V is written
    block_tables: torch.Tensor  # [num_seqs, max_blocks] (padded with 0)
    seq_lens: torch.Tensor  # [num_seqs] context length after this step
    query_start_loc: torch.Tensor  # [num_seqs + 1]
    num_decodes: int  # the first num_decodes sequences have one query token each
    decode_slots: torch.Tensor | None  # [num_decodes, max_len] context slots (padded)
    decode_mask: torch.Tensor | None  # [num_decodes, 1, 1, max_len] bool, True = attend
    prefills: list[PrefillSpan]


class TorchAttention:
    """The default backend. KV cache layout: [2, num_slots, num_kv_heads, head_dim]."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.group = num_heads // num_kv_heads
        self.scale = head_dim ** -0.5

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
        kv_cache: torch.Tensor, meta: AttentionMetadata,
    ) -> torch.Tensor:
        """q: [T, Hq, D]; k, v: [T, Hkv, D]. Returns [T, Hq * D]."""
        k_cache, v_cache = kv_cache[0], kv_cache[1]
        k_cache.index_copy_(0, meta.slot_mapping, k)
        v_cache.index_copy_(0, meta.slot_mapping, v)
        out = torch.empty_like(q)
        nd = meta.num_decodes
        if nd:
            out[:nd] = self._decode(q[:nd], k_cache, v_cache, meta)
        for span in meta.prefills:
            out[span.q_start:span.q_end] = self._prefill(
                q[span.q_start:span.q_end], k_cache, v_cache, span)
        return out.view(q.shape[0], -1)

    def _decode(self, q, k_cache, v_cache, meta: AttentionMetadata) -> torch.Tensor:
        # One query token per sequence: fold the query heads of a KV group into the
        # query-length axis, so GQA needs no K/V expansion.
        b = q.shape[0]
        k = k_cache[meta.decode_slots].transpose(1, 2)  # [B, Hkv, L, D]
        v = v_cache[meta.decode_slots].transpose(1, 2)
        qg = q.view(b, self.num_kv_heads, self.group, self.head_dim)
        o = F.scaled_dot_product_attention(qg, k, v, attn_mask=meta.decode_mask, scale=self.scale)
        return o.reshape(b, self.num_heads, self.head_dim)

    def _prefill(self, q, k_cache, v_cache, span: PrefillSpan) -> torch.Tensor:
        k = k_cache[span.context_slots].transpose(0, 1).unsqueeze(0)  # [1, Hkv, L, D]
        v = v_cache[span.context_slots].transpose(0, 1).unsqueeze(0)
        q = q.transpose(0, 1).unsqueeze(0)  # [1, Hq, Lq, D]
        if self.group > 1:
            k = k.repeat_interleave(self.group, dim=1)
            v = v.repeat_interleave(self.group, dim=1)
        if span.mask is None:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale)
        else:
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=span.mask, scale=self.scale)
        return o[0].transpose(0, 1)
