"""The int8 KV cache's rows (executor/kv_quant.py): the native write gives the PyTorch form's bits,
a row round-trips within half a step of its grid, a scale byte is the smallest of its grid that
fits the group, and the native decode kernel over int8 rows equals SDPA over the dequantised rows
and the query as it scores them (int16 steps of each head's max) to float rounding."""

from __future__ import annotations

import pytest
import torch
from test_attention import _reference

from tandem.executor import triton_attention
from tandem.executor.attention import AttentionMetadata, TorchAttention, decode_buckets
from tandem.executor.kv_quant import (
    decode_scales,
    dequantize_kv_rows,
    encode_scales,
    quantize_kv_rows,
    read_kv,
    row_len,
    scale_group,
    write_kv,
)
from tandem.kernels import cpu_paged_attention


@pytest.fixture(scope="module")
def ext():
    ext = cpu_paged_attention()
    if ext is None:
        pytest.skip("no C++ toolchain: the engine uses the PyTorch path")
    return ext


def _rows(*shape, seed=0, dtype=torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g) * torch.rand(*shape[:-1], 1, generator=g) * 8
    x[0, 0] = 0.0  # an all-zero row: the smallest scale, values 0
    x[1, 0, 3] = 300.0  # an outlier: its group's grid widens, no other group's
    return x.to(dtype)


def test_a_row_has_one_scale_up_to_64_values_else_one_per_32():
    """row_len follows scale_group, and dequantize_kv_rows finds head_dim from a row's length
    (row_len's inverse) for every head_dim up to 512."""
    assert [scale_group(d) for d in (1, 16, 64, 65, 80, 128, 256)] == [64] * 3 + [32] * 4
    rows = [row_len(d, torch.int8) for d in (16, 64, 65, 96, 128, 256)]
    assert rows == [17, 65, 68, 99, 132, 264]
    assert row_len(256, torch.bfloat16) == 256
    for d in range(1, 513):
        row = row_len(d, torch.int8)
        assert row == d + -(-d // scale_group(d))
        back = dequantize_kv_rows(torch.zeros(row, dtype=torch.int8), torch.float32)
        assert back.shape == (d,)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "head_dim,groups", [(64, 1), (128, 4), (256, 8), (80, 3), (96, 3), (48, 1)]
)
def test_a_row_round_trips_within_half_a_step(dtype, head_dim, groups):
    x = _rows(64, 3, head_dim, dtype=dtype)
    rows = quantize_kv_rows(x)
    assert rows.dtype == torch.int8 and rows.shape == (64, 3, head_dim + groups)
    back = dequantize_kv_rows(rows, torch.float32)
    scales = decode_scales(rows[..., head_dim:].view(torch.uint8))
    group = scale_group(head_dim)
    amax = torch.nn.functional.pad(x.float().abs(), (0, -head_dim % group))
    amax = amax.unflatten(-1, (-1, group)).amax(-1)
    assert (scales <= amax / 127 * 1.125 + 1e-6).all()  # at most 1/8 over the max's
    step = scales.repeat_interleave(group, -1)[..., :head_dim]
    assert ((back - x.float()).abs() <= step * (0.5 + 2e-3)).all()
    assert back[0, 0].eq(0).all() and rows[..., :head_dim].abs().max() <= 127


def test_a_scale_byte_is_the_smallest_that_fits():
    """Every byte's scale times 127 covers the max |x| that encodes to it, and the byte below
    does not (rounded up, never down: no value clips); the range ends clamp."""
    scales = decode_scales(torch.arange(256, dtype=torch.uint8))
    assert scales[0] == 2.0**-20 and scales[8] == 2.0**-19 and scales[255] == 1.875 * 2.0**11
    assert (scales[1:] > scales[:-1]).all()
    g = torch.Generator().manual_seed(5)
    amax = 2.0 ** (torch.rand(10_000, generator=g) * 30 - 14)
    amax = torch.cat([amax, scales * 127, torch.tensor([0.0, 1e-30, 1e9])])
    codes = encode_scales(amax, 127.0).long()
    s = decode_scales(codes.to(torch.uint8))
    inside = (amax >= 127 * 2.0**-20) & (amax <= scales[-1] * 127)
    assert (s[inside] * 127 >= amax[inside] * (1 - 1e-6)).all()
    below = decode_scales((codes - 1).clamp(min=0).to(torch.uint8))
    assert (below[inside & (codes > 0)] * 127 < amax[inside & (codes > 0)]).all()
    assert codes[-3:].tolist() == [0, 0, 255]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", [64, 128, 256, 80, 96])
def test_native_write_gives_the_pytorch_bits(ext, dtype, head_dim):
    k, v = (_rows(40, 2, head_dim, seed=s, dtype=dtype) for s in (1, 2))
    slots = torch.randperm(64)[:40]
    native = torch.zeros(2, 64, 2, row_len(head_dim, torch.int8), dtype=torch.int8)
    ext.reshape_and_cache_int8(k, v, native, slots)
    plain = torch.zeros_like(native)
    plain[0, slots], plain[1, slots] = quantize_kv_rows(k), quantize_kv_rows(v)
    assert torch.equal(native, plain)
    read = read_kv(native[1], slots, torch.float32)
    assert torch.equal(read, dequantize_kv_rows(plain[1, slots], torch.float32))


def _int16_query(q: torch.Tensor, scale: float) -> torch.Tensor:
    """q as the kernel scores int8 K rows with it: q * scale rounded, head by head, to 32767
    steps of its max |q|; divided back by scale for a reference that applies it again."""
    qf = q.float() * scale
    amax = qf.abs().amax(-1, keepdim=True)
    q16 = torch.where(amax > 0, torch.round(qf * (32767 / amax)), 0.0)
    return q16 * (amax / 32767) / scale


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize(
    "heads,kv_heads,head_dim", [(9, 3, 64), (4, 1, 64), (4, 4, 128), (8, 1, 256), (10, 2, 128)]
)
@pytest.mark.parametrize("window", [None, 20], ids=["global", "window-20"])
def test_decode_kernel_over_int8_equals_sdpa_over_the_dequantised_rows(
    ext, dtype, tol, heads, kv_heads, head_dim, window
):
    g = torch.Generator().manual_seed(0)
    bs, num_blocks, batch = 16, 64, 7
    k_rows = quantize_kv_rows(torch.randn(num_blocks * bs, kv_heads, head_dim, generator=g))
    v_rows = quantize_kv_rows(torch.randn(num_blocks * bs, kv_heads, head_dim, generator=g))
    seq_lens = torch.tensor([1, 5, 16, 17, 100, 250, 33])
    max_blocks = (int(seq_lens.max()) + bs - 1) // bs
    pick = [torch.randperm(num_blocks, generator=g)[:max_blocks] for _ in range(batch)]
    tables = torch.stack(pick)
    q = torch.randn(batch, heads, head_dim, generator=g).to(dtype)
    out = ext.paged_decode_attention(
        q, k_rows, v_rows, tables, seq_lens, bs, head_dim**-0.5, window or 0
    )
    k, v = (dequantize_kv_rows(r, torch.float32) for r in (k_rows, v_rows))
    ref = _reference(_int16_query(q, head_dim**-0.5), k, v, tables, seq_lens, bs, window)
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("d", [64, 256])
def test_fused_qkv_writes_and_attends_as_the_separate_ops(ext, dtype, d):
    """forward_qkv's quantised write and attention give forward's bits (its write through
    write_kv), and the SDPA buckets (no kernel) read the same rows, with the kernel's int16
    query, to float rounding."""
    g = torch.Generator().manual_seed(1)
    heads, kv_heads, bs, batch = 9, 3, 16, 5
    seq_lens = torch.tensor([1, 7, 16, 17, 90])
    tables = torch.stack([torch.randperm(40, generator=g)[:6] for _ in range(batch)])
    slots = torch.stack(
        [tables[b, (n - 1) // bs] * bs + (n - 1) % bs for b, n in enumerate(seq_lens.tolist())]
    )
    cache = quantize_kv_rows(torch.randn(2, 40 * bs, kv_heads, d, generator=g))
    qkv = torch.randn(batch, (heads + 2 * kv_heads) * d, generator=g).to(dtype)
    meta = AttentionMetadata(
        slots,
        tables,
        seq_lens,
        torch.arange(batch + 1),
        batch,
        [],
        [],
        bs,
        decode_kernel=ext.paged_decode_attention,
    )
    attn = TorchAttention(heads, kv_heads, d)
    fused_cache, plain_cache, torch_cache = cache.clone(), cache.clone(), cache.clone()
    fused = attn.forward_qkv(qkv, fused_cache, meta)
    q, k, v = (t.reshape(batch, -1, d) for t in qkv.split([heads * d, *[kv_heads * d] * 2], -1))
    plain = attn.forward(q, k, v, plain_cache, meta)
    assert torch.equal(fused, plain) and torch.equal(fused_cache, plain_cache)
    assert not torch.equal(fused_cache, cache)
    torch_cache[0, slots], torch_cache[1, slots] = quantize_kv_rows(k), quantize_kv_rows(v)
    assert torch.equal(torch_cache, fused_cache)
    meta.decode_kernel = None
    meta.decodes = decode_buckets(tables.numpy(), seq_lens.numpy(), bs, torch.device("cpu"))
    q = _int16_query(q.float(), d**-0.5).to(dtype)  # the query as the kernel scores with it
    buckets = attn.forward(q, k, v, cache.clone(), meta)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(buckets.float(), fused.float(), atol=tol, rtol=tol)


def test_write_without_the_kernel_is_the_pytorch_form(monkeypatch):
    import tandem.executor.kv_quant as kv_quant

    monkeypatch.setattr(kv_quant, "cpu_paged_attention", lambda: None)
    k, v = _rows(8, 2, 64, seed=3), _rows(8, 2, 64, seed=4)
    cache, slots = torch.zeros(2, 16, 2, 64 + 1, dtype=torch.int8), torch.arange(8) * 2
    write_kv(k, v, cache, slots)
    assert torch.equal(cache[0, slots], quantize_kv_rows(k)) and cache[:, 1::2].eq(0).all()


def _fp8_exact_rows(t: int, heads: int, d: int, g: torch.Generator) -> torch.Tensor:
    """Rows that quantise with no rounding: e4m3 values times a power of two, each group's max
    |x| 448 times it. The interpreter's fp32 -> fp8 cast mis-rounds a carry into the exponent
    (124.1 -> 64), so under it only such rows check the write (layout, scales, slots); CUDA's
    cvt.rn rounds."""
    grid = torch.randint(-120, 121, (t, heads, d), generator=g).to(torch.float8_e4m3fn).float()
    grid[..., :: scale_group(d)] = 448.0
    return grid * 2.0 ** torch.randint(-10, -7, (t, heads, 1), generator=g).float()


@pytest.mark.skipif(not triton_attention.available(), reason="triton is not installed")
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize(
    "heads,kv_heads,head_dim,window", [(6, 3, 64, 0), (4, 1, 32, 6), (4, 2, 96, 0)]
)
def test_triton_fp8_cache_equals_the_pytorch_reading_of_it(
    dtype, tol, heads, kv_heads, head_dim, window
):
    """The Triton KV write lays out fp8 rows and scales as quantize_kv_rows(fp8) does, skipping
    padding slots, and the unified attention over the fp8 cache equals the PyTorch path over the
    same rows (under TRITON_INTERPRET=1 on CPU: conftest.py)."""
    from test_triton_attention import DEVICE, _batch, _reference_meta

    g = torch.Generator().manual_seed(2)
    bs, query_lens, context_lens = 8, [1, 1, 9, 30], [3, 40, 33, 0]
    tables, seq_lens, qsl, slots = _batch(query_lens, context_lens, bs, 64, g)
    t = sum(query_lens)
    q = torch.randn(t, heads, head_dim, generator=g).to(dtype).to(DEVICE)
    k, v = (_fp8_exact_rows(t, kv_heads, head_dim, g).to(dtype).to(DEVICE) for _ in "kv")
    fp8 = torch.float8_e4m3fn
    cache = quantize_kv_rows(torch.randn(2, 64 * bs, kv_heads, head_dim, generator=g), fp8)
    cache = cache.to(DEVICE)
    meta = _reference_meta(tables, seq_lens, qsl, slots, query_lens, bs)
    ref_cache = cache.clone()
    attn = TorchAttention(heads, kv_heads, head_dim, sliding_window=window or None)
    ref = attn.forward(q, k, v, ref_cache, meta).view(t, heads, head_dim)
    padded = meta.slot_mapping.clone()
    padded[0] = -1  # a CUDA graph's padding token writes nothing
    triton_attention.reshape_and_cache(k, v, cache, padded)
    assert not torch.equal(
        cache[:, slots[0]].view(torch.uint8), ref_cache[:, slots[0]].view(torch.uint8)
    )
    triton_attention.reshape_and_cache(k, v, cache, meta.slot_mapping)
    assert torch.equal(cache.view(torch.uint8), ref_cache.view(torch.uint8))
    out = triton_attention.unified_attention(
        q, cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, max(query_lens), bs,
        head_dim**-0.5, window,
    )  # fmt: skip
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)
