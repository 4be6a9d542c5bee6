"""The int8 KV cache's rows: a K or V row of head_dim values is stored as head_dim int8 values and
their fp16 scale (max |x| / 127) in two more bytes, [..., head_dim + 2] int8. The scale lives in
the row, so every block copy (swap, P/D transfer, the prefix cache's shared blocks) moves it with
the values. A scale per token and KV head follows outliers of one token without widening the grid
of the others, and a row is written once, never rescaled when its block fills.

The native kernels (kernels/cpu_paged_attention.cpp) write and read these rows; the functions here
are the same arithmetic in PyTorch, bit for bit, for the gather paths (SDPA prefill and decode
buckets) and where no kernel was built."""

from __future__ import annotations

import torch

from tandem.kernels import cpu_paged_attention

SCALE_BYTES = 2  # an fp16 scale after each int8 row


def row_len(head_dim: int, dtype: torch.dtype) -> int:
    """Elements of a cache row of this dtype."""
    return head_dim + SCALE_BYTES if dtype == torch.int8 else head_dim


def quantize_kv_rows(x: torch.Tensor) -> torch.Tensor:
    """[..., D] floats as int8 rows [..., D + 2]: scale = (max |x| / 127) rounded to fp16, values
    round(x / scale) (half to even, as the kernel's nearbyint), written as x * (1 / scale)."""
    xf = x.float()
    scale = (xf.abs().amax(-1, keepdim=True) * (1.0 / 127.0)).half()
    s = scale.float()
    inv = torch.where(s > 0, 1.0 / s, 0.0)
    q = (xf * inv).round_().clamp_(-127, 127).to(torch.int8)
    return torch.cat([q, scale.view(torch.int8)], -1)


def dequantize_kv_rows(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """int8 rows [..., D + 2] as [..., D] values in `dtype` (fp32 arithmetic)."""
    d = rows.shape[-1] - SCALE_BYTES
    scale = rows[..., d:].contiguous().view(torch.float16).float()
    return (rows[..., :d].float() * scale).to(dtype)


def write_kv(
    k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """A layer's new K and V [T, Hkv, D] into its cache [2, slots, Hkv, row] at slot_mapping: a
    float cache narrower than them rounds here; an int8 cache quantises each row."""
    if kv_cache.dtype != torch.int8:
        kv_cache[0].index_copy_(0, slot_mapping, k.to(kv_cache.dtype))
        kv_cache[1].index_copy_(0, slot_mapping, v.to(kv_cache.dtype))
        return
    ext = cpu_paged_attention() if kv_cache.device.type == "cpu" else None
    if ext is not None and k.stride(-1) == 1 and v.stride(-1) == 1:
        ext.reshape_and_cache_int8(k, v, kv_cache, slot_mapping)
        return
    kv_cache[0].index_copy_(0, slot_mapping, quantize_kv_rows(k))
    kv_cache[1].index_copy_(0, slot_mapping, quantize_kv_rows(v))


def read_kv(cache: torch.Tensor, slots: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The rows at `slots` of one of a layer's caches ([slots, Hkv, row]) as [n, Hkv, D] in
    `dtype`: widened, or dequantised from int8."""
    rows = cache.index_select(0, slots)  # several times faster than advanced indexing on CPU
    return dequantize_kv_rows(rows, dtype) if cache.dtype == torch.int8 else rows.to(dtype)
