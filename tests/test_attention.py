"""The native CPU paged decode kernel agrees with plain SDPA over gathered K/V, with and without
a sliding window."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tandem.kernels import cpu_paged_attention


def _reference(q, k_cache, v_cache, block_tables, seq_lens, bs, window=None):
    out = torch.empty_like(q, dtype=torch.float32)
    group = q.shape[1] // k_cache.shape[1]
    for b in range(q.shape[0]):
        n = int(seq_lens[b])
        t = torch.arange(0 if window is None else max(0, n - window), n)
        slots = block_tables[b, t // bs] * bs + t % bs
        k = k_cache[slots].transpose(0, 1).float().repeat_interleave(group, 0)
        v = v_cache[slots].transpose(0, 1).float().repeat_interleave(group, 0)
        out[b] = F.scaled_dot_product_attention(q[b].float().unsqueeze(1), k, v).squeeze(1)
    return out


# (activations, KV cache, tolerance): a cache narrower than fp32 activations is read widened, so
# the fp32 reference over the same cache values holds to fp32's tolerance
DTYPE_PAIRS = [
    (torch.float32, torch.float32, 1e-5),
    (torch.bfloat16, torch.bfloat16, 2e-2),
    (torch.float32, torch.bfloat16, 1e-5),
    (torch.float32, torch.float16, 1e-5),
]
PAIR_IDS = ["fp32", "bf16", "fp32-over-bf16", "fp32-over-fp16"]


@pytest.mark.parametrize("dtype,kv_dtype,tol", DTYPE_PAIRS, ids=PAIR_IDS)
@pytest.mark.parametrize(
    "heads,kv_heads,head_dim",
    [(9, 3, 64), (4, 4, 128), (8, 2, 64), (4, 1, 256), (12, 2, 64), (10, 2, 128)],
)  # groups of 6 and 5: 4 + 2, 4 + 1
@pytest.mark.parametrize("window", [None, 20], ids=["global", "window-20"])
def test_native_decode_matches_sdpa(dtype, kv_dtype, tol, heads, kv_heads, head_dim, window):
    ext = cpu_paged_attention()
    if ext is None:
        pytest.skip("no C++ toolchain: the engine uses the PyTorch path")
    g = torch.Generator().manual_seed(0)
    bs, num_blocks, batch = 16, 64, 7
    k_cache = torch.randn(num_blocks * bs, kv_heads, head_dim, generator=g).to(kv_dtype)
    v_cache = torch.randn(num_blocks * bs, kv_heads, head_dim, generator=g).to(kv_dtype)
    seq_lens = torch.tensor([1, 5, 16, 17, 100, 250, 33])
    max_blocks = (int(seq_lens.max()) + bs - 1) // bs
    block_tables = torch.stack(
        [torch.randperm(num_blocks, generator=g)[:max_blocks] for _ in range(batch)]
    )
    q = torch.randn(batch, heads, head_dim, generator=g).to(dtype)
    out = ext.paged_decode_attention(
        q, k_cache, v_cache, block_tables, seq_lens, bs, head_dim**-0.5, window or 0
    )
    ref = _reference(q, k_cache, v_cache, block_tables, seq_lens, bs, window)
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), ref, atol=tol, rtol=tol)


def test_native_decode_refuses_a_cache_wider_than_the_activations():
    ext = cpu_paged_attention()
    if ext is None:
        pytest.skip("no C++ toolchain: the engine uses the PyTorch path")
    q, cache = torch.zeros(1, 2, 64, dtype=torch.bfloat16), torch.zeros(16, 1, 64)
    with pytest.raises(RuntimeError, match="BFloat16 activations over a Float KV cache"):
        ext.paged_decode_attention(
            q,
            cache,
            cache,
            torch.zeros(1, 1, dtype=torch.long),
            torch.ones(1, dtype=torch.long),
            16,
            0.125,
            0,
        )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("window", [None, 100], ids=["global", "window-100"])
def test_native_decode_splits_long_contexts_and_is_batch_invariant(dtype, window):
    """Contexts of many parts (the kernel splits a context into fixed parts the threads share)
    match SDPA, and a sequence's output is bit for bit the same alone as in a batch, whatever
    the thread count: the parts follow its own length, never the batch's."""
    ext = cpu_paged_attention()
    if ext is None:
        pytest.skip("no C++ toolchain: the engine uses the PyTorch path")
    g = torch.Generator().manual_seed(1)
    bs, heads, kv_heads, head_dim = 16, 4, 1, 256
    seq_lens = torch.tensor([700, 3, 129, 64, 65, 1000])
    max_blocks = (int(seq_lens.max()) + bs - 1) // bs
    num_blocks = max_blocks * len(seq_lens)
    k_cache = torch.randn(num_blocks * bs, kv_heads, head_dim, generator=g).to(dtype)
    v_cache = torch.randn(num_blocks * bs, kv_heads, head_dim, generator=g).to(dtype)
    block_tables = torch.randperm(num_blocks, generator=g)[:num_blocks].view(
        len(seq_lens), max_blocks
    )
    q = torch.randn(len(seq_lens), heads, head_dim, generator=g).to(dtype)
    scale = head_dim**-0.5
    threads = torch.get_num_threads()
    try:
        batched = ext.paged_decode_attention(
            q, k_cache, v_cache, block_tables, seq_lens, bs, scale, window or 0
        )
        torch.set_num_threads(1)
        for b in range(len(seq_lens)):
            alone = ext.paged_decode_attention(
                q[b : b + 1],
                k_cache,
                v_cache,
                block_tables[b : b + 1],
                seq_lens[b : b + 1],
                bs,
                scale,
                window or 0,
            )
            assert torch.equal(alone[0], batched[b]), f"sequence {b} differs alone and in the batch"
    finally:
        torch.set_num_threads(threads)
    ref = _reference(q, k_cache, v_cache, block_tables, seq_lens, bs, window)
    tol = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 3e-3}[dtype]
    torch.testing.assert_close(batched.float(), ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("bs", [1, 3, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 20], ids=["global", "window-20"])
def test_one_kv_head_read_in_place_equals_the_gathered_rows(bs, dtype, window):
    """With one KV head the kernel reads a part's V rows where they lie, block by block; with
    more it gathers them first. Head 0 of a two-head cache is the one-head cache, so its query
    heads' outputs must be the same bits either way, at block sizes that split a part into many
    blocks."""
    ext = cpu_paged_attention()
    if ext is None:
        pytest.skip("no C++ toolchain: the engine uses the PyTorch path")
    g = torch.Generator().manual_seed(2)
    group, head_dim = 4, 256
    seq_lens = torch.tensor([1, 3, 64, 65, 150])
    max_blocks = (int(seq_lens.max()) + bs - 1) // bs
    num_blocks = max_blocks * len(seq_lens)
    k2, v2 = (torch.randn(num_blocks * bs, 2, head_dim, generator=g).to(dtype) for _ in range(2))
    block_tables = torch.randperm(num_blocks, generator=g).view(len(seq_lens), max_blocks)
    q = torch.randn(len(seq_lens), 2 * group, head_dim, generator=g).to(dtype)
    args = (block_tables, seq_lens, bs, head_dim**-0.5, window or 0)
    one = ext.paged_decode_attention(
        q[:, :group].contiguous(), k2[:, :1].contiguous(), v2[:, :1].contiguous(), *args
    )
    two = ext.paged_decode_attention(q, k2, v2, *args)
    assert torch.equal(one, two[:, :group])


def test_kernel_build_dir_is_shared_by_content_and_drops_a_stale_lock(tmp_path):
    """Two checkouts of the same kernel source share one build; a lock left by an interrupted
    build (a server killed on its first start) is removed instead of blocking every later
    start forever, and a fresh one (a build under way) is waited for."""
    import os
    import subprocess
    import threading
    import time

    from tandem.kernels import LOCK_GRACE_S, STALE_LOCK_S, build_dir

    a = b = b"int x;\n"
    build, src = build_dir("k.cpp", a, tmp_path / "kernels")
    assert (
        build_dir("k.cpp", b, tmp_path / "kernels") == (build, src)
        and src.read_text() == "int x;\n"
    )
    lock = build / "lock"
    old = time.time() - STALE_LOCK_S - 1
    lock.touch()
    os.utime(lock, (old, old))
    build_dir("k.cpp", a, tmp_path / "kernels")
    assert not lock.exists()
    lock.touch()  # fresh: another process is building; its lock goes when it is done
    threading.Timer(0.3, lock.unlink).start()
    t0 = time.monotonic()
    build_dir("k.cpp", a, tmp_path / "kernels")
    assert (
        0.25 < time.monotonic() - t0 < STALE_LOCK_S and not lock.exists()
    )  # waited, not timed out
    # Past the grace period, a lock is kept while a process builds in the folder (however slow
    # the machine), and removed once none does.
    lock.touch()
    old = time.time() - LOCK_GRACE_S - 1
    os.utime(lock, (old, old))
    builder = subprocess.Popen(["sleep", "1"], cwd=build)
    t0 = time.monotonic()
    build_dir("k.cpp", a, tmp_path / "kernels")
    assert time.monotonic() - t0 > 0.5 and builder.poll() is not None and not lock.exists()
    assert (
        build_dir("k.cpp", b"int y;\n", tmp_path / "kernels")[0] != build
    )  # other source, other build


@pytest.mark.parametrize(
    "dtype,kv_dtype",
    [
        (torch.float32, torch.float32),
        (torch.bfloat16, torch.bfloat16),
        (torch.float32, torch.bfloat16),
        (torch.float32, torch.float16),
    ],
    ids=["fp32", "bf16", "fp32-over-bf16", "fp32-over-fp16"],
)
def test_decode_from_fused_qkv_equals_the_separate_ops(dtype, kv_dtype):
    """forward_qkv (KV write and attention in one native call on the fused projection) gives the
    same bits as forward (index_copy_ into the cache, then the decode kernel), cache included, a
    narrower cache rounded as torch rounds; it declines a step with a prefill."""
    from tandem.executor.attention import AttentionMetadata, TorchAttention

    ext = cpu_paged_attention()
    if ext is None:
        pytest.skip("no C++ toolchain: the engine uses the PyTorch path")
    g = torch.Generator().manual_seed(1)
    heads, kv_heads, d, bs, batch = 9, 3, 64, 16, 5
    seq_lens = torch.tensor([1, 7, 16, 17, 90])
    tables = torch.stack([torch.randperm(40, generator=g)[:6] for _ in range(batch)])
    slots = torch.stack(
        [tables[b, (n - 1) // bs] * bs + (n - 1) % bs for b, n in enumerate(seq_lens.tolist())]
    )
    cache = torch.randn(2, 40 * bs, kv_heads, d, generator=g).to(kv_dtype)
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
    fused_cache, plain_cache = cache.clone(), cache.clone()
    fused = attn.forward_qkv(qkv, fused_cache, meta)
    q, k, v = qkv.split([heads * d, kv_heads * d, kv_heads * d], -1)
    plain = attn.forward(
        q.reshape(batch, heads, d),
        k.reshape(batch, kv_heads, d),
        v.reshape(batch, kv_heads, d),
        plain_cache,
        meta,
    )
    assert torch.equal(fused, plain) and torch.equal(fused_cache, plain_cache)
    assert not torch.equal(fused_cache, cache) and fused.dtype == dtype
    meta.num_decodes = batch - 1  # the last row a prefill: not this path
    assert attn.forward_qkv(qkv, cache, meta) is None


@pytest.mark.parametrize("native", [True, False], ids=["decode-kernel", "sdpa-buckets"])
@pytest.mark.parametrize("dtype,kv_dtype,tol", DTYPE_PAIRS[:3], ids=PAIR_IDS[:3])
@pytest.mark.parametrize("window", [None, 6, 10], ids=["global", "window-6", "window-10"])
def test_verify_query_as_one_token_rows_equals_its_causal_chunk(
    native, dtype, kv_dtype, tol, window
):
    """A verify query (a decode plus its drafts) given as one one-token row per position, each
    attending to the context up to its own position (how the model runner builds a verify step
    on the torch backend), attends as the same query does as one causal chunk after its cached
    context; a decode and a prefill chunk share the batch, and the K/V written is the same. In a
    sliding-window layer too (windows shorter than the chunk and than its context): the decode
    path's window and the prefill path's agree."""
    import numpy as np

    from tandem.executor.attention import TorchAttention, build_attention_metadata

    ext = cpu_paged_attention()
    if native and ext is None:
        pytest.skip("no C++ toolchain: the engine uses the PyTorch path")
    g = torch.Generator().manual_seed(2)
    heads, kv_heads, d, bs, num_blocks = 9, 3, 64, 16, 64
    # request 0: a decode at 40 cached; 1: a verify of 5 positions at 30 cached;
    # 2: a 7-token chunk at 20
    cached, qlens = np.array([40, 30, 20]), np.array([1, 5, 7])
    tables = np.stack(
        [torch.randperm(num_blocks, generator=g)[:4].numpy() for _ in range(3)]
    ).astype(np.int64)
    req = np.repeat(np.arange(3), qlens)
    positions = np.concatenate([np.arange(c, c + q) for c, q in zip(cached, qlens)])
    slots = tables[req, positions // bs] * bs + positions % bs
    t = int(qlens.sum())
    q, k, v = (torch.randn(t, h, d, generator=g).to(dtype) for h in (heads, kv_heads, kv_heads))
    cache = torch.randn(2, num_blocks * bs, kv_heads, d, generator=g).to(kv_dtype)
    kernel = ext.paged_decode_attention if native else None
    per_request = build_attention_metadata(
        tables, cached + qlens, qlens, slots, bs, torch.device("cpu"), kernel
    )
    row_req = np.concatenate([req[:6], [2]])  # the decode and each verify position, then the chunk
    rows = build_attention_metadata(
        tables[row_req],
        np.concatenate([positions[:6] + 1, [27]]),
        np.array([1] * 6 + [7]),
        slots,
        bs,
        torch.device("cpu"),
        kernel,
    )
    assert (per_request.num_decodes, len(per_request.prefills)) == (1, 2)
    assert (rows.num_decodes, len(rows.prefills)) == (6, 1)
    attn = TorchAttention(heads, kv_heads, d, sliding_window=window)
    ref_cache, row_cache = cache.clone(), cache.clone()
    ref = attn.forward(q, k, v, ref_cache, per_request)
    out = attn.forward(q, k, v, row_cache, rows)
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)
    assert torch.equal(ref_cache, row_cache)
