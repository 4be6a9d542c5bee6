"""The native CPU paged prefill kernel agrees with SDPA over gathered K/V (whole prompts, chunks
after a cached prefix, several sequences in a call, sliding windows, GQA), and a query's output is
the same bits whatever chunk, batch or thread count it comes in."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tandem.kernels import cpu_prefill_attention


def _ext():
    ext = cpu_prefill_attention()
    if ext is None:
        pytest.skip("no C++ toolchain: the engine uses the PyTorch path")
    return ext


def _reference(q, k_cache, v_cache, block_tables, seq_lens, qsl, bs, window=None):
    """SDPA per sequence over its gathered context, masked causal (and to the window)."""
    out = torch.empty_like(q, dtype=torch.float32)
    group = q.shape[1] // k_cache.shape[1]
    for b in range(len(seq_lens)):
        n, lo, hi = int(seq_lens[b]), int(qsl[b]), int(qsl[b + 1])
        t = torch.arange(n)
        slots = block_tables[b, t // bs] * bs + t % bs
        k = k_cache[slots].transpose(0, 1).float().repeat_interleave(group, 0)
        v = v_cache[slots].transpose(0, 1).float().repeat_interleave(group, 0)
        qpos = torch.arange(n - (hi - lo), n)[:, None]
        mask = t[None, :] <= qpos
        if window is not None:
            mask &= t[None, :] > qpos - window
        qb = q[lo:hi].float().transpose(0, 1)
        out[lo:hi] = F.scaled_dot_product_attention(qb, k, v, attn_mask=mask).transpose(0, 1)
    return out


def _batch(query_lens, context_lens, kv_heads, head_dim, kv_dtype, g, bs=16):
    seq_lens = torch.tensor([c + q for c, q in zip(context_lens, query_lens)])
    max_blocks = (int(seq_lens.max()) + bs - 1) // bs
    num_blocks = max_blocks * len(seq_lens)
    block_tables = torch.randperm(num_blocks, generator=g).view(len(seq_lens), max_blocks)
    k_cache, v_cache = (
        torch.randn(num_blocks * bs, kv_heads, head_dim, generator=g).to(kv_dtype) for _ in range(2)
    )
    qsl = torch.zeros(len(query_lens) + 1, dtype=torch.long)
    qsl[1:] = torch.tensor(query_lens).cumsum(0)
    return k_cache, v_cache, block_tables, seq_lens, qsl


DTYPE_PAIRS = [
    (torch.float32, torch.float32, 1e-5),
    (torch.bfloat16, torch.bfloat16, 2e-2),
    (torch.float32, torch.bfloat16, 1e-5),
    (torch.float32, torch.float16, 1e-5),
]
PAIR_IDS = ["fp32", "bf16", "fp32-over-bf16", "fp32-over-fp16"]


@pytest.mark.parametrize("dtype,kv_dtype,tol", DTYPE_PAIRS, ids=PAIR_IDS)
@pytest.mark.parametrize(
    "heads,kv_heads,head_dim", [(9, 3, 64), (4, 4, 128), (4, 1, 256), (12, 2, 64), (16, 1, 64)]
)
@pytest.mark.parametrize("window", [None, 1, 20, 100], ids=lambda w: f"window-{w}")
def test_native_prefill_matches_sdpa(dtype, kv_dtype, tol, heads, kv_heads, head_dim, window):
    """Whole prompts, chunks after a cached prefix (inside a block and across tiles), one-token
    rows and a long chunk, in one call."""
    ext = _ext()
    g = torch.Generator().manual_seed(0)
    query_lens, context_lens = [300, 7, 1, 45, 130, 2], [0, 33, 90, 64, 200, 0]
    k_cache, v_cache, tables, seq_lens, qsl = _batch(
        query_lens, context_lens, kv_heads, head_dim, kv_dtype, g
    )
    q = torch.randn(sum(query_lens), heads, head_dim, generator=g).to(dtype)
    scale = head_dim**-0.5
    out = ext.paged_prefill_attention(
        q, k_cache, v_cache, tables, seq_lens, qsl, 16, scale, window or 0
    )
    ref = _reference(q, k_cache, v_cache, tables, seq_lens, qsl, 16, window)
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("window", [None, 50], ids=["global", "window-50"])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (4, 1, 256)])
def test_native_prefill_is_chunk_batch_and_thread_invariant(window, heads, kv_heads, head_dim):
    """A prompt prefilled whole, in chunks over its cached prefix, alone or beside other
    sequences, on one thread or all: every query's output is the same bits (key tiles follow
    positions, never the chunk or the batch)."""
    ext = _ext()
    g = torch.Generator().manual_seed(1)
    n, bs, scale = 333, 16, head_dim**-0.5
    k_cache, v_cache, tables, seq_lens, qsl = _batch(
        [n, 100], [0, 20], kv_heads, head_dim, torch.float32, g, bs
    )
    q = torch.randn(n + 100, heads, head_dim, generator=g)
    whole = ext.paged_prefill_attention(
        q, k_cache, v_cache, tables, seq_lens, qsl, bs, scale, window or 0
    )
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        for cut in ([0, 1, 129, 200, n], [0, 5, 6, n]):
            for lo, hi in zip(cut[:-1], cut[1:]):
                chunk = ext.paged_prefill_attention(
                    q[lo:hi],
                    k_cache,
                    v_cache,
                    tables[:1],
                    torch.tensor([hi]),
                    torch.tensor([0, hi - lo]),
                    bs,
                    scale,
                    window or 0,
                )
                assert torch.equal(chunk, whole[lo:hi]), f"chunk [{lo}, {hi}) differs"
    finally:
        torch.set_num_threads(threads)


def test_native_prefill_reads_nothing_outside_the_windows():
    """Blocks wholly before every query's window are not read: NaN there changes nothing."""
    ext = _ext()
    g = torch.Generator().manual_seed(2)
    bs, window = 16, 40
    k_cache, v_cache, tables, seq_lens, qsl = _batch([30], [200], 2, 64, torch.float32, g, bs)
    q = torch.randn(30, 4, 64, generator=g)
    args = (tables, seq_lens, qsl, bs, 0.125, window)
    ref = ext.paged_prefill_attention(q, k_cache, v_cache, *args)
    first = 200 - window + 1  # the first query's window starts here
    blocks = first // bs
    stale = tables[0, :blocks].repeat_interleave(bs) * bs + torch.arange(bs).repeat(blocks)
    k_cache[stale], v_cache[stale] = float("nan"), float("nan")
    assert torch.equal(ext.paged_prefill_attention(q, k_cache, v_cache, *args), ref)


def test_native_prefill_in_attention_layer_matches_sdpa_path():
    """TorchAttention with the native prefill kernel gives the SDPA path's output beside decodes,
    and writes the same cache."""
    from tandem.executor.attention import TorchAttention, build_attention_metadata

    ext = _ext()
    g = torch.Generator().manual_seed(3)
    heads, kv_heads, d, bs, num_blocks = 9, 3, 64, 16, 64
    cached, qlens = np.array([40, 30, 0]), np.array([1, 50, 70])
    tables = np.stack(
        [torch.randperm(num_blocks, generator=g)[:8].numpy() for _ in range(3)]
    ).astype(np.int64)
    req = np.repeat(np.arange(3), qlens)
    positions = np.concatenate([np.arange(c, c + q) for c, q in zip(cached, qlens)])
    slots = tables[req, positions // bs] * bs + positions % bs
    t = int(qlens.sum())
    q, k, v = (torch.randn(t, h, d, generator=g) for h in (heads, kv_heads, kv_heads))
    cache = torch.randn(2, num_blocks * bs, kv_heads, d, generator=g)
    args = (tables, cached + qlens, qlens, slots, bs, torch.device("cpu"))
    for window in (None, 20):
        attn = TorchAttention(heads, kv_heads, d, sliding_window=window)
        sdpa_cache, native_cache = cache.clone(), cache.clone()
        ref = attn.forward(q, k, v, sdpa_cache, build_attention_metadata(*args))
        native = build_attention_metadata(*args, prefill_kernel=ext.paged_prefill_attention)
        assert native.prefills == []
        out = attn.forward(q, k, v, native_cache, native)
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
        assert torch.equal(sdpa_cache, native_cache)
