"""The native fused CPU ops (kernels/cpu_fused_ops.cpp) give the PyTorch path's bits."""

from __future__ import annotations

import pytest
import torch

from tandem.kernels import cpu_fused_ops
from tandem.models.layers.layernorm import RMSNorm, add_rms_norm
from tandem.models.layers.rotary_embedding import RotaryEmbedding, apply_rope

ext = cpu_fused_ops()
pytestmark = pytest.mark.skipif(ext is None, reason="no C++ toolchain here")
DTYPES = pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])


def _norm(dim: int, dtype: torch.dtype) -> RMSNorm:
    norm = RMSNorm(dim, 1e-5)
    norm.weight.data = torch.randn(dim).to(dtype)
    return norm


def _torch_norm(norm: RMSNorm, x: torch.Tensor) -> torch.Tensor:
    x32 = x.float()
    return norm.weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + norm.eps)).to(
        x.dtype
    )


@DTYPES
def test_rms_norm_and_add_rms_norm(dtype):
    torch.manual_seed(0)
    norm, x, residual = (
        _norm(576, dtype),
        torch.randn(7, 576).to(dtype),
        torch.randn(7, 576).to(dtype),
    )
    # fp32: the sum of squares is accumulated in another order than torch's mean: ulps only.
    tol = dict(rtol=0, atol=0) if dtype == torch.bfloat16 else dict(rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(norm(x), _torch_norm(norm, x), **tol)
    s, normed = add_rms_norm(x, residual, norm.weight, norm.eps)
    assert torch.equal(s, residual + x)
    torch.testing.assert_close(normed, _torch_norm(norm, residual + x), **tol)


@DTYPES
def test_rope_in_place_on_qkv(dtype):
    torch.manual_seed(1)
    nq, nkv, hd, t = 9, 3, 64, 5
    rotary = RotaryEmbedding(hd, 512, 10000.0, None)
    positions = torch.tensor([0, 3, 17, 200, 511])
    qkv = torch.randn(t, (nq + 2 * nkv) * hd).to(dtype)
    q, k, v = qkv.split([nq * hd, nkv * hd, nkv * hd], -1)
    cos, sin = rotary.cos_sin[positions].chunk(2, -1)
    cos, sin = (
        torch.cat([cos, cos], -1).unsqueeze(1).to(dtype),
        torch.cat([sin, sin], -1).unsqueeze(1).to(dtype),
    )
    want_q, want_k = (
        apply_rope(q.reshape(t, nq, hd), cos, sin),
        apply_rope(k.reshape(t, nkv, hd), cos, sin),
    )
    want_v = v.clone()
    rope = rotary(positions, dtype)
    ext.rope_(qkv, rope.positions, rope.table, nq + nkv, hd)
    q, k, v = qkv.split([nq * hd, nkv * hd, nkv * hd], -1)
    assert torch.equal(q.reshape(t, nq, hd), want_q) and torch.equal(k.reshape(t, nkv, hd), want_k)
    assert torch.equal(v, want_v)


def test_rope_table_grows_with_the_positions_seen():
    """On CPU the table covers the positions seen (doubling, capped at the context), and its rows
    equal the whole-context table's, rounding through the model's dtype included."""
    whole = RotaryEmbedding(64, 20000, 10000.0, {"rope_type": "linear", "factor": 2.0})
    whole.cos_sin = whole._table(20000)
    rotary = RotaryEmbedding(64, 20000, 10000.0, {"rope_type": "linear", "factor": 2.0})
    for r in (whole, rotary):
        r.round_through(torch.bfloat16)
    assert rotary.cos_sin.shape[0] == RotaryEmbedding.MIN_POSITIONS
    rotary(torch.tensor([3, 9000]), torch.float32)
    assert rotary.cos_sin.shape[0] == 16384 and torch.equal(rotary.cos_sin, whole.cos_sin[:16384])
    rotary(torch.tensor([19999]), torch.float32)
    assert torch.equal(rotary.cos_sin, whole.cos_sin)


@DTYPES
def test_qk_norm_in_place_on_qkv(dtype):
    """Each q head normed with q's weight, each k head with k's, v untouched: the modules'
    result."""
    torch.manual_seed(2)
    nq, nkv, hd, t = 4, 1, 256, 3
    q_norm, k_norm = _norm(hd, dtype), _norm(hd, dtype)
    qkv = torch.randn(t, (nq + 2 * nkv) * hd).to(dtype) * 4
    q, k, v = (p.reshape(t, -1, hd) for p in qkv.split([nq * hd, nkv * hd, nkv * hd], -1))
    want_q, want_k, want_v = _torch_norm(q_norm, q), _torch_norm(k_norm, k), v.clone()
    ext.qk_rms_norm_(qkv, q_norm.weight, k_norm.weight, nq, nkv, hd, q_norm.eps)
    q, k, v = (p.reshape(t, -1, hd) for p in qkv.split([nq * hd, nkv * hd, nkv * hd], -1))
    tol = dict(rtol=0, atol=0) if dtype == torch.bfloat16 else dict(rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(q, want_q, **tol)
    torch.testing.assert_close(k, want_k, **tol)
    assert torch.equal(v, want_v)
