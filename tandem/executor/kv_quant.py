"""The quantised KV caches' rows: a K or V row of head_dim values is stored as head_dim one-byte
values and their fp16 scale (max |x| / 127 for int8, the CPU's; max |x| / 448 for fp8 e4m3, the
Triton kernels') in two more bytes, [..., head_dim + 2]. The scale lives in the row, so every
block copy (swap, P/D transfer, the prefix cache's shared blocks) moves it with the values. A
scale per token and KV head follows outliers of one token without widening the grid of the
others, and a row is written once, never rescaled when its block fills.

The kernels (kernels/cpu_paged_attention.cpp, executor/triton_attention.py) write and read these
rows; the functions here are the same arithmetic in PyTorch, bit for bit, for the gather paths
(SDPA prefill and decode buckets), where no kernel was built, and as the kernels' reference."""

from __future__ import annotations

import torch

from tandem.kernels import cpu_paged_attention

SCALE_BYTES = 2  # an fp16 scale after each row
QMAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}  # the quantised dtypes' largest value


def row_len(head_dim: int, dtype: torch.dtype) -> int:
    """Elements of a cache row of this dtype."""
    return head_dim + SCALE_BYTES if dtype in QMAX else head_dim


def quantize_kv_rows(x: torch.Tensor, dtype: torch.dtype = torch.int8) -> torch.Tensor:
    """[..., D] floats as rows [..., D + 2] of `dtype`: scale = (max |x| / qmax) rounded to fp16,
    values x / scale rounded to the dtype (int8: half to even, as the kernel's nearbyint), written
    as x * (1 / scale)."""
    qmax = QMAX[dtype]
    xf = x.float()
    scale = (xf.abs().amax(-1, keepdim=True) * (1.0 / qmax)).half()
    s = scale.float()
    q = (xf * torch.where(s > 0, 1.0 / s, 0.0)).clamp_(-qmax, qmax)
    q = q.round_().to(dtype) if dtype == torch.int8 else q.to(dtype)
    return torch.cat([q, scale.view(dtype)], -1)


def dequantize_kv_rows(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Quantised rows [..., D + 2] as [..., D] values in `dtype` (fp32 arithmetic)."""
    d = rows.shape[-1] - SCALE_BYTES
    scale = rows[..., d:].contiguous().view(torch.float16).float()
    return (rows[..., :d].float() * scale).to(dtype)


def write_kv(
    k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """A layer's new K and V [T, Hkv, D] into its cache [2, slots, Hkv, row] at slot_mapping: a
    float cache narrower than them rounds here; a quantised cache quantises each row."""
    if kv_cache.dtype not in QMAX:
        kv_cache[0].index_copy_(0, slot_mapping, k.to(kv_cache.dtype))
        kv_cache[1].index_copy_(0, slot_mapping, v.to(kv_cache.dtype))
        return
    native = kv_cache.dtype == torch.int8 and kv_cache.device.type == "cpu"
    ext = cpu_paged_attention() if native else None
    if ext is not None and k.stride(-1) == 1 and v.stride(-1) == 1:
        ext.reshape_and_cache_int8(k, v, kv_cache, slot_mapping)
        return
    for cache, x in zip(kv_cache.view(torch.uint8), (k, v)):  # CPU copies take no fp8
        cache.index_copy_(0, slot_mapping, quantize_kv_rows(x, kv_cache.dtype).view(torch.uint8))


def read_kv(cache: torch.Tensor, slots: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The rows at `slots` of one of a layer's caches ([slots, Hkv, row]) as [n, Hkv, D] in
    `dtype`: widened, or dequantised."""
    if cache.dtype not in QMAX:  # index_select: several times faster than indexing on CPU
        return cache.index_select(0, slots).to(dtype)
    rows = cache.view(torch.uint8).index_select(0, slots).view(cache.dtype)  # CPU takes no fp8
    return dequantize_kv_rows(rows, dtype)
