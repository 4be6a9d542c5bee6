"""Paged attention over a flattened batch, in plain PyTorch (runs on CPU and any device).

Metadata is in the form a paged kernel takes (slot_mapping, block_tables, seq_lens,
query_start_loc); the gather indices and masks derived from it are built once per step and
shared by every layer (`build_attention_metadata`, one builder for the model runner and the
draft proposer). The batch is ordered one-token rows first, by context length: decodes, and on
the torch backend each position of a verify query (a decode plus its drafts) as a row of its
own, so verification costs a decode kernel call rather than a chunked-prefill one. On CPU the
single-token queries run in one call of a native paged kernel that reads K/V in place
(kernels/cpu_paged_attention.cpp), and a decode-only step writes K/V and attends in one call
on the layer's fused qkv (`forward_qkv`); elsewhere, or without a compiler, they run as a few padded
SDPA calls over buckets of similar length (padding costs bandwidth). The multi-token (prefill)
queries run on CPU in one call of a native flash-style kernel that reads K/V in place, only the
window of a sliding-window layer (kernels/cpu_prefill_attention.cpp); elsewhere each runs its
own causal SDPA call over its gathered context. On CUDA (`triton` backend) one Triton launch
writes the layer's K/V and one attends for the whole batch (executor/triton_attention.py).
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from tandem.config import AttentionBackend
from tandem.executor.device import to_device
from tandem.executor.kv_quant import read_kv, write_kv
from tandem.kernels import cpu_paged_attention


@dataclass(slots=True)
class PrefillSpan:
    q_start: int
    q_end: int
    context_slots: torch.Tensor  # [seq_len] cache slots of the whole context, new tokens included
    mask: torch.Tensor | None  # [q_len, seq_len] bool; None: plain causal (no earlier context)


@dataclass(slots=True)
class DecodeBucket:
    start: int  # first decode row
    end: int
    slots: torch.Tensor  # [rows * max_len] context slots, flattened, padded
    mask: torch.Tensor  # [rows, 1, 1, max_len] bool, True = attend


@dataclass(slots=True)
class AttentionMetadata:
    # Per attention row (a request's query, or one position of a verify query: see
    # build_attention_metadata):
    slot_mapping: torch.Tensor  # [num_tokens] where each new token's K/V is written
    block_tables: torch.Tensor  # [num_rows, max_blocks] (padded with 0)
    seq_lens: torch.Tensor  # [num_rows] context length after this step
    query_start_loc: torch.Tensor  # [num_rows + 1]
    num_decodes: int  # the first num_decodes rows have one query token each
    decodes: list[DecodeBucket]  # empty when decode_kernel or Triton runs them
    prefills: list[PrefillSpan]  # empty with Triton
    block_size: int = 16
    decode_kernel: Callable | None = None  # native paged decode attention, when available
    prefill_kernel: Callable | None = None  # native paged prefill attention: no prefill spans
    triton: bool = False  # the Triton kernels run the whole batch
    max_query_len: int = 1
    # sliding window -> (decodes, prefills) that see only it: built by the first layer of that
    # window in a step, shared by the others
    windowed: dict[int, tuple[list[DecodeBucket], list[PrefillSpan]]] = field(default_factory=dict)

    def rows_for(self, window: int | None) -> tuple[list[DecodeBucket], list[PrefillSpan]]:
        """The step's SDPA decode buckets and prefill spans for a layer with this sliding window."""
        if window is None:
            return self.decodes, self.prefills
        if window not in self.windowed:
            self.windowed[window] = (
                [_windowed_bucket(b, self.seq_lens[b.start : b.end], window) for b in self.decodes],
                [_windowed_span(span, window) for span in self.prefills],
            )
        return self.windowed[window]


def _windowed_bucket(bucket: DecodeBucket, seq_lens: torch.Tensor, window: int) -> DecodeBucket:
    """The bucket's mask also hides the keys before each row's last `window` positions."""
    grid = torch.arange(bucket.mask.shape[-1], device=bucket.mask.device)
    recent = grid[None, :] >= (seq_lens - window)[:, None]
    return DecodeBucket(
        bucket.start, bucket.end, bucket.slots, bucket.mask & recent[:, None, None, :]
    )


def _windowed_span(span: PrefillSpan, window: int) -> PrefillSpan:
    """The span with only the keys some query of it can see (the window before its first query
    on), and the mask of each query's window: key k is seen from query q when q - window < k <= q
    (transformers' sliding window)."""
    seq_len, q_len = span.context_slots.shape[0], span.q_end - span.q_start
    first = seq_len - q_len  # the first query's position
    if first == 0 and q_len <= window:
        return span  # plain causal already sees only the window
    lo = max(0, first - window + 1)
    device = span.context_slots.device
    q_pos = torch.arange(first, seq_len, device=device)[:, None]
    k_pos = torch.arange(lo, seq_len, device=device)[None, :]
    return PrefillSpan(
        span.q_start,
        span.q_end,
        span.context_slots[lo:],
        (k_pos <= q_pos) & (k_pos > q_pos - window),
    )


def build_attention_metadata(
    block_tables: np.ndarray,
    seq_lens: np.ndarray,
    query_lens: np.ndarray,
    slot_mapping: np.ndarray,
    block_size: int,
    device: torch.device,
    decode_kernel: Callable | None = None,
    triton: bool = False,
    prefill_kernel: Callable | None = None,
) -> AttentionMetadata:
    """A step's metadata from its attention rows (host arrays): row i's query is the last
    query_lens[i] tokens of its context of seq_lens[i] tokens, in the blocks block_tables[i];
    one-token rows come first (roughly by context length, so padded buckets pad little).

    A row is not a request: the model runner gives a verify query (a decode plus its k drafts)
    as k + 1 one-token rows, each attending to the context up to its own position, which is the
    query's causal attention; every position's K/V is written before any row attends."""
    num_rows = len(query_lens)
    qsl = np.zeros(num_rows + 1, dtype=np.int64)
    np.cumsum(query_lens, out=qsl[1:])
    multi = np.flatnonzero(query_lens > 1)
    num_decodes = int(multi[0]) if len(multi) else num_rows
    decodes, prefills = [], []
    if decode_kernel is None and not triton:
        decodes = decode_buckets(
            block_tables[:num_decodes], seq_lens[:num_decodes], block_size, device
        )
    for i in range(num_decodes, num_rows) if not (triton or prefill_kernel) else ():
        ctx = np.arange(int(seq_lens[i]))
        slots = torch.from_numpy(
            block_tables[i, ctx // block_size] * block_size + ctx % block_size
        ).to(device)
        cached = int(seq_lens[i] - query_lens[i])
        mask = None  # no earlier context: plain causal
        if cached:
            qpos = cached + np.arange(int(query_lens[i]))
            mask = torch.from_numpy(ctx[None, :] <= qpos[:, None]).to(device)
        prefills.append(PrefillSpan(int(qsl[i]), int(qsl[i + 1]), slots, mask))
    return AttentionMetadata(
        slot_mapping=to_device(slot_mapping, device),
        block_tables=to_device(block_tables, device),
        seq_lens=to_device(seq_lens, device),
        query_start_loc=to_device(qsl, device),
        num_decodes=num_decodes,
        decodes=decodes,
        prefills=prefills,
        block_size=block_size,
        decode_kernel=decode_kernel,
        prefill_kernel=prefill_kernel,
        triton=triton,
        max_query_len=int(query_lens.max(initial=1)),
    )


def decode_buckets(
    block_tables: np.ndarray, seq_lens: np.ndarray, block_size: int, device: torch.device
) -> list[DecodeBucket]:
    """The padded SDPA buckets of one-token queries (rows roughly sorted by context length), for
    where no paged kernel runs them: each row's context slots and mask."""
    bs, buckets = block_size, []
    for start, end in _length_buckets(seq_lens):
        grid = np.arange(int(seq_lens[start:end].max()))
        slots = block_tables[start:end, grid // bs] * bs + grid % bs
        mask = grid[None, :] < seq_lens[start:end, None]
        buckets.append(
            DecodeBucket(
                start,
                end,
                torch.from_numpy(slots.reshape(-1)).to(device),
                torch.from_numpy(mask[:, None, None, :]).to(device),
            )
        )
    return buckets


def _length_buckets(
    lens: np.ndarray, min_rows: int = 8, max_pad: float = 1.5
) -> list[tuple[int, int]]:
    """Split (roughly) sorted context lengths into runs whose longest is at most `max_pad` times the
    shortest (runs of at least `min_rows`, so call overhead stays small)."""
    buckets, start = [], 0
    for i in range(1, len(lens)):
        if i - start >= min_rows and lens[i] > max_pad * lens[start]:
            buckets.append((start, i))
            start = i
    if len(lens):
        buckets.append((start, len(lens)))
    return buckets


def resolve_attention_backend(name: AttentionBackend, device: torch.device) -> AttentionBackend:
    """auto: Triton on CUDA when it is installed, else PyTorch. Triton on CPU runs only in its
    interpreter (TRITON_INTERPRET=1, for tests). Triton is imported only when it is chosen (it
    costs ~90 MiB of RSS)."""
    installed = importlib.util.find_spec("triton") is not None
    if name == AttentionBackend.AUTO:
        if device.type == "cuda" and installed:
            return AttentionBackend.TRITON
        return AttentionBackend.TORCH
    if name == AttentionBackend.TRITON:
        if not installed:
            raise ValueError(
                "attention_backend 'triton' needs the triton package (pip install triton)"
            )
        if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError(
                "attention_backend 'triton' on CPU runs only under TRITON_INTERPRET=1 (slow; tests)"
            )
    return name


class TorchAttention:
    """Every layer's attention: PyTorch (and the CPU kernel), or the Triton kernels when
    meta.triton. KV cache layout: [2, num_slots, num_kv_heads, head_dim], in the activations'
    dtype or, under fp32 on CPU, bf16 / fp16 (K and V are rounded as they are written, widened as
    they are read); or int8 on CPU, rows of head_dim values and their scale bytes (kv_quant.py)."""

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float | None = None,
        sliding_window: int | None = None,
    ) -> None:
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.group = num_heads // num_kv_heads
        self.scale = head_dim**-0.5 if scale is None else scale
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1, got {sliding_window}")
        self.sliding_window = sliding_window
        self.window_arg = sliding_window or 0  # the kernels' form: 0, the whole context

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """q: [T, Hq, D]; k, v: [T, Hkv, D]. Returns [T, Hq * D]."""
        if meta.triton:
            from tandem.executor import triton_attention

            triton_attention.reshape_and_cache(k, v, kv_cache, meta.slot_mapping)
            return triton_attention.unified_attention(
                q,
                kv_cache,
                meta.block_tables,
                meta.seq_lens,
                meta.query_start_loc,
                meta.max_query_len,
                meta.block_size,
                self.scale,
                self.window_arg,
            ).view(q.shape[0], -1)
        write_kv(k, v, kv_cache, meta.slot_mapping)
        k_cache, v_cache = kv_cache[0], kv_cache[1]
        out = torch.empty_like(q)
        nd = meta.num_decodes
        if nd and meta.decode_kernel is not None:
            out[:nd] = meta.decode_kernel(
                q[:nd].contiguous(),
                k_cache,
                v_cache,
                meta.block_tables[:nd],
                meta.seq_lens[:nd],
                meta.block_size,
                self.scale,
                self.window_arg,
            )
        if meta.prefill_kernel is not None and nd < q.shape[0]:
            out[nd:] = meta.prefill_kernel(
                q[nd:],
                k_cache,
                v_cache,
                meta.block_tables[nd:],
                meta.seq_lens[nd:],
                meta.query_start_loc[nd:],
                meta.block_size,
                self.scale,
                self.window_arg,
            )
        decodes, prefills = meta.rows_for(self.sliding_window)
        for bucket in decodes:
            out[bucket.start : bucket.end] = self._decode(
                q[bucket.start : bucket.end], k_cache, v_cache, bucket
            )
        for span in prefills:
            out[span.q_start : span.q_end] = self._prefill(
                q[span.q_start : span.q_end], k_cache, v_cache, span
            )
        return out.view(q.shape[0], -1)

    def forward_qkv(
        self, qkv: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor | None:
        """A decode-only step with the native CPU kernel (meta.decode_kernel set): the KV write
        and the attention in one call on the layer's fused projection qkv [T, (Hq + 2 Hkv) D],
        RoPE applied; the same arithmetic as forward. None: not such a step (use forward)."""
        if not self.decodes_qkv(meta, qkv.shape[0]) or not qkv.is_contiguous():
            return None
        return cpu_paged_attention().paged_decode_qkv(
            qkv,
            kv_cache,
            meta.slot_mapping,
            meta.block_tables,
            meta.seq_lens,
            self.num_heads,
            meta.block_size,
            self.scale,
            self.window_arg,
        )

    @staticmethod
    def decodes_qkv(meta: AttentionMetadata, rows: int) -> bool:
        """Whether forward_qkv runs a step of `rows` rows with this metadata (given a contiguous
        qkv)."""
        return meta.decode_kernel is not None and not meta.triton and meta.num_decodes == rows

    def _decode(self, q, k_cache, v_cache, bucket: DecodeBucket) -> torch.Tensor:
        # One query token per sequence: fold the query heads of a KV group into the
        # query-length axis, so GQA needs no K/V expansion.
        b, length = q.shape[0], bucket.mask.shape[-1]
        shape = (b, length, self.num_kv_heads, self.head_dim)
        k = read_kv(k_cache, bucket.slots, q.dtype).view(shape).transpose(1, 2)  # [B, Hkv, L, D]
        v = read_kv(v_cache, bucket.slots, q.dtype).view(shape).transpose(1, 2)
        qg = q.view(b, self.num_kv_heads, self.group, self.head_dim)
        o = F.scaled_dot_product_attention(qg, k, v, attn_mask=bucket.mask, scale=self.scale)
        return o.reshape(b, self.num_heads, self.head_dim)

    def _prefill(self, q, k_cache, v_cache, span: PrefillSpan) -> torch.Tensor:
        k = read_kv(k_cache, span.context_slots, q.dtype).transpose(0, 1)[None]  # [1, Hkv, L, D]
        v = read_kv(v_cache, span.context_slots, q.dtype).transpose(0, 1)[None]
        q = q.transpose(0, 1).unsqueeze(0)  # [1, Hq, Lq, D]
        if self.group > 1:
            k = k.repeat_interleave(self.group, dim=1)
            v = v.repeat_interleave(self.group, dim=1)
        if span.mask is None:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale)
        else:
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=span.mask, scale=self.scale)
        return o[0].transpose(0, 1)
