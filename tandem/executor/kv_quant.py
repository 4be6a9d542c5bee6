"""The quantised KV caches' rows: a K or V row of head_dim values is stored as head_dim one-byte
values (int8 on the CPU, fp8 e4m3 in the Triton kernels) and then one scale byte per GROUP of them:
[..., head_dim + ceil(head_dim / GROUP)]. The scales live in the row, so every block copy (swap,
P/D transfer, the prefix cache's shared blocks) moves them with the values. Scales per token and
KV head follow outliers of one token without widening the grid of the others, and a row is written
once, never rescaled when its block fills; a group of 64 keeps one outlier from coarsening a whole
256-value row (Gemma 3's head_dim).

A scale byte is an unsigned float with 5 exponent and 3 mantissa bits, 2^-20 to 1.875 * 2^11:
its fp32 bits are (byte << 20) + SCALE_BIAS_BITS. It is max |x| / qmax rounded up to that grid, so
the group's largest value still fits (|x| / scale <= qmax), at worst 1/8 coarser than an exact
scale; one byte, not an fp16's two, lets a head_dim-64 row of 65 bytes hold 1.97x bf16's tokens.

The kernels (kernels/cpu_paged_attention.cpp, executor/triton_attention.py) write and read these
rows; the functions here are the same arithmetic in PyTorch, bit for bit, for the gather paths
(SDPA prefill and decode buckets), where no kernel was built, and as the kernels' reference."""

from __future__ import annotations

import torch

from tandem.kernels import cpu_paged_attention

QMAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}  # the quantised dtypes' largest value
GROUP = 64  # values per scale byte (kernels: kScaleGroup)
SCALE_BIAS_BITS = 107 << 23  # a scale byte's exponent 0 is 2^-20: fp32 exponent field 107


def row_len(head_dim: int, dtype: torch.dtype) -> int:
    """Elements of a cache row of this dtype: the values, then a scale byte per group."""
    return head_dim + -(-head_dim // GROUP) if dtype in QMAX else head_dim


def _head_dim(row: int) -> int:
    """row_len's inverse: a row of n groups holds GROUP (n - 1) + r values (1 <= r <= GROUP) and n
    scale bytes, so n = ceil(row / (GROUP + 1))."""
    return row - -(-row // (GROUP + 1))


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
    written as x * (1 / scale). A last group shorter than GROUP is padded with zeros for its max."""
    qmax, d = QMAX[dtype], x.shape[-1]
    xf = torch.nn.functional.pad(x.float(), (0, -d % GROUP)).unflatten(-1, (-1, GROUP))
    codes = encode_scales(xf.abs().amax(-1), qmax)
    inv = 1.0 / decode_scales(codes).unsqueeze(-1)
    q = (xf * inv).clamp_(-qmax, qmax).flatten(-2)[..., :d]
    q = q.round_().to(dtype) if dtype == torch.int8 else q.to(dtype)
    return torch.cat([q.view(torch.uint8), codes], -1).view(dtype)


def dequantize_kv_rows(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Quantised rows [..., row_len(D)] as [..., D] values in `dtype` (fp32 arithmetic)."""
    d = _head_dim(rows.shape[-1])
    scales = decode_scales(rows[..., d:].view(torch.uint8)).unsqueeze(-1)
    values = torch.nn.functional.pad(rows[..., :d].float(), (0, -d % GROUP))
    return (values.unflatten(-1, (-1, GROUP)) * scales).flatten(-2)[..., :d].to(dtype)


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
