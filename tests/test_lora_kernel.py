"""The native LoRA kernel (kernels/cpu_lora_sgmv.cpp) against the products written out in torch:
segments of any length, slots without this layer's adapter, odd ranks, inputs and widths."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from tandem.kernels import cpu_lora_sgmv
from tandem.models.lora.adapter import LoRAWeights
from tandem.models.lora.layer import LoRABatch, LoRALinear

pytestmark = pytest.mark.skipif(
    cpu_lora_sgmv() is None, reason="no C++ toolchain for the native kernel"
)


def _weights(g: torch.Generator, k: int, widths: list[int], rank: int) -> LoRAWeights:
    a = torch.randn(len(widths) * rank, k, generator=g)
    b = tuple(torch.randn(w, rank, generator=g) for w in widths)
    return LoRAWeights(a, b, tuple(sum(widths[:i]) for i in range(len(widths))))


def _cast(w: LoRAWeights | None, dtype: torch.dtype) -> LoRAWeights | None:
    if w is None:
        return None
    return LoRAWeights(w.a.to(dtype), tuple(b.to(dtype) for b in w.b), w.rows)


def _expected(x: torch.Tensor, slots: np.ndarray, weights: list[LoRAWeights | None], n: int):
    y = torch.zeros(x.shape[0], n, dtype=torch.float64)
    for i, slot in enumerate(slots.tolist()):
        w = weights[slot] if slot >= 0 else None
        if w is None:
            continue
        rank = w.a.shape[0] // len(w.b)
        t = x[i].double() @ w.a.double().T
        for p, (col, b) in enumerate(zip(w.rows, w.b)):
            y[i, col : col + b.shape[0]] += b.double() @ t[p * rank : (p + 1) * rank]
    return y


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("k", "widths", "rank"), [(64, [64, 16, 16], 16), (37, [29, 11], 5), (96, [40], 64)]
)
def test_segments_match_torch(dtype, k, widths, rank):
    g = torch.Generator().manual_seed(0)
    n = sum(widths)
    weights = [_weights(g, k, widths, rank), None, _weights(g, k, widths, rank // 2 or 1)]
    batch = LoRABatch()
    layer = LoRALinear(nn.Linear(k, n, bias=False).to(dtype), batch, len(weights))
    for slot, w in enumerate(weights):
        layer.set_slot(slot, _cast(w, dtype))
    slots = np.array([-1, 0, 0, 0, 0, 0, 1, 1, 2, -1, 2, 2, 2, 2, 2, 2, 2, 0], dtype=np.int64)
    assert batch.set(slots)
    x = torch.randn(len(slots), k, generator=g).to(dtype)
    with torch.no_grad():
        base = layer.base(x)
        assert layer._native(x, base)
        got = layer(x).double() - base.double()
    # against the products of the weights as stored, in fp64; bf16 rounds the sum once
    want = _expected(x.float(), slots, [_cast(_cast(w, dtype), torch.float32) for w in weights], n)
    scale = (want.abs() + base.double().abs()).max().item()
    assert (got - want).abs().max().item() <= scale * (1e-5 if dtype == torch.float32 else 1e-2)
