"""The native CPU paged decode kernel agrees with plain SDPA over gathered K/V."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tandem.kernels import cpu_paged_attention


def _reference(q, k_cache, v_cache, block_tables, seq_lens, bs):
    out = torch.empty_like(q, dtype=torch.float32)
    group = q.shape[1] // k_cache.shape[1]
    for b in range(q.shape[0]):
        t = torch.arange(int(seq_lens[b]))
        slots = block_tables[b, t // bs] * bs + t % bs
        k = k_cache[slots].transpose(0, 1).float().repeat_interleave(group, 0)
        v = v_cache[slots].transpose(0, 1).float().repeat_interleave(group, 0)
        out[b] = F.scaled_dot_product_attention(q[b].float().unsqueeze(1), k, v).squeeze(1)
    return out


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (4, 4, 128), (8, 2, 64)])
def test_native_decode_matches_sdpa(dtype, tol, heads, kv_heads, head_dim):
    ext = cpu_paged_attention()
    if ext is None:
        pytest.skip("no C++ toolchain: the engine uses the PyTorch path")
    g = torch.Generator().manual_seed(0)
    bs, num_blocks, batch = 16, 64, 7
    k_cache = torch.randn(num_blocks * bs, kv_heads, head_dim, generator=g).to(dtype)
    v_cache = torch.randn(num_blocks * bs, kv_heads, head_dim, generator=g).to(dtype)
    seq_lens = torch.tensor([1, 5, 16, 17, 100, 250, 33])
    max_blocks = (int(seq_lens.max()) + bs - 1) // bs
    block_tables = torch.stack([torch.randperm(num_blocks, generator=g)[:max_blocks] for _ in range(batch)])
    q = torch.randn(batch, heads, head_dim, generator=g).to(dtype)
    out = ext.paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, bs, head_dim ** -0.5)
    ref = _reference(q, k_cache, v_cache, block_tables, seq_lens, bs)
    torch.testing.assert_close(out.float(), ref, atol=tol, rtol=tol)


def test_kernel_build_dir_is_shared_by_content_and_drops_a_stale_lock(tmp_path):
    """Two checkouts of the same kernel source share one build; a lock left by an interrupted
    build (a server killed on its first start) is removed instead of blocking every later
    start forever, and a fresh one (a build under way) is waited for."""
    import os
    import threading
    import time

    from tandem.kernels import STALE_LOCK_S, build_dir
    a, b = tmp_path / "a" / "k.cpp", tmp_path / "b" / "k.cpp"
    for p in (a, b):
        p.parent.mkdir()
        p.write_text("int x;\n")
    build, src = build_dir(a, tmp_path / "kernels")
    assert build_dir(b, tmp_path / "kernels") == (build, src) and src.read_text() == "int x;\n"
    lock = build / "lock"
    old = time.time() - STALE_LOCK_S - 1
    lock.touch()
    os.utime(lock, (old, old))
    build_dir(a, tmp_path / "kernels")
    assert not lock.exists()
    lock.touch()  # fresh: another process is building; its lock goes when it is done
    threading.Timer(0.3, lock.unlink).start()
    t0 = time.monotonic()
    build_dir(a, tmp_path / "kernels")
    assert 0.25 < time.monotonic() - t0 < STALE_LOCK_S and not lock.exists()  # waited, not timed out
    b.write_text("int y;\n")
    assert build_dir(b, tmp_path / "kernels")[0] != build  # other source, other build
