"""The quantised KV caches' rows: a K or V row of head_dim values is stored as head_dim one-byte
values (int8 on the CPU, fp8 e4m3 in the Triton kernels) and then one scale byte per group of
scale_group(head_dim) of them: [..., row_len(head_dim)]. The scales live in the row, so every block
copy (swap, P/D transfer, the prefix cache's shared blocks) moves them with the values. Scales per
token and KV head follow outliers of one token without widening the grid of the others, and a row
is written once, never rescaled when its block fills.

A scale byte is an unsigned float with 5 exponent and 3 mantissa bits, 2^-20 to 1.875 * 2^11:
its fp32 bits are (byte << 20) + SCALE_BIAS_BITS. It is max |x| / qmax rounded up to that grid, so
the group's largest value still fits (|x| / scale <= qmax), at worst 1/8 coarser than an exact
scale; one byte, not an fp16's two, lets a head_dim-64 row of 65 bytes hold 1.97x bf16's tokens.

The kernels (kernels/cpu_paged_attention.cpp, executor/triton_attention.py) write and read these
rows; the functions here are the same arithmetic in PyTorch, bit for bit, for the gather paths
(SDPA prefill and decode buckets), where no kernel was built, and as the kernels' reference."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from tandem.kernels import cpu_paged_attention

if TYPE_CHECKING:
    from tandem.models.config import ModelConfig

QMAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}  # the quantised dtypes' largest value
SCALE_BIAS_BITS = 107 << 23  # a scale byte's exponent 0 is 2^-20: fp32 exponent field 107


def scale_group(head_dim: int) -> int:
    """Values per scale byte in a row of head_dim (the kernels: scale_group): one scale for a row
    of up to 64 (65 bytes at 64: the ~1B shape's 16 contexts of 32,000 tokens fit 8 GiB), else one
    per 32, so an outlier coarsens fewer values (Gemma 3's 256: 264 bytes, 1.94x bf16's tokens)."""
    return 64 if head_dim <= 64 else 32


def row_len(head_dim: int, dtype: torch.dtype) -> int:
    """Elements of a cache row of this dtype: the values, then a scale byte per group."""
    return head_dim + -(-head_dim // scale_group(head_dim)) if dtype in QMAX else head_dim


def kv_bytes_per_token(cfg: ModelConfig, dtype: torch.dtype) -> int:
    """A token's K and V rows of every layer in a cache of this dtype."""
    return 2 * cfg.num_layers * cfg.num_kv_heads * row_len(cfg.head_dim, dtype) * dtype.itemsize


def _head_dim(row: int) -> int:
    """row_len's inverse. A row with one scale byte holds row - 1 <= 64 values, and a row of more
    than 64 values is longer than 65: either way scale_group(row - 1) is the row's group g. A row
    of n groups holds g (n - 1) + r values (1 <= r <= g) and n scale bytes, so
    n = ceil(row / (g + 1))."""
    group = scale_group(row - 1)
    return row - -(-row // (group + 1))


def encode_scales(amax: torch.Tensor, qmax: float) -> torch.Tensor:
    """Scale bytes (uint8) for groups whose largest |x| is amax (fp32): amax * (1 / qmax) rounded
    up to 3 mantissa bits, clamped to the byte's range."""
    bits = (amax * (1.0 / qmax)).view(torch.int32)
    return (((bits + 0xFFFFF) >> 20) - (SCALE_BIAS_BITS >> 20)).clamp_(0, 255).to(torch.uint8)


def decode_scales(codes: torch.Tensor) -> torch.Tensor:
    """Scale bytes (uint8) as fp32 scales."""
    return ((codes.to(torch.int32) << 20) + SCALE_BIAS_BITS).view(torch.float32)


def quantize_kv_rows(x: torch.Tensor, dtype: torch.dtype = torch.int8) -> torch.Tensor:
    """[..., D] floats as rows [..., row_len(D)] of `dtype`: per group, scale = encode_scales of its
    max |x|, values x / scale rounded to the dtype (int8: half to even, as the kernel's nearbyint),
    written as x * (1 / scale). A last group shorter than the others is padded with zeros for its
    max."""
    qmax, d = QMAX[dtype], x.shape[-1]
    group = scale_group(d)
    xf = torch.nn.functional.pad(x.float(), (0, -d % group)).unflatten(-1, (-1, group))
    codes = encode_scales(xf.abs().amax(-1), qmax)
    inv = 1.0 / decode_scales(codes).unsqueeze(-1)
    q = (xf * inv).clamp_(-qmax, qmax).flatten(-2)[..., :d]
    q = q.round_().to(dtype) if dtype == torch.int8 else q.to(dtype)
    return torch.cat([q.view(torch.uint8), codes], -1).view(dtype)


def dequantize_kv_rows(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Quantised rows [..., row_len(D)] as [..., D] values in `dtype` (fp32 arithmetic)."""
    d = _head_dim(rows.shape[-1])
    group = scale_group(d)
    scales = decode_scales(rows[..., d:].view(torch.uint8)).unsqueeze(-1)
    values = torch.nn.functional.pad(rows[..., :d].float(), (0, -d % group))
    return (values.unflatten(-1, (-1, group)) * scales).flatten(-2)[..., :d].to(dtype)


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
