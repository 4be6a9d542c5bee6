"""bf16 linears on oneDNN see few distinct row counts: a primitive (and its scratch memory) is
cached per row count and never freed, so padding the rows bounds what a long-running server
holds."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from tandem.models.layers.linear import (
    can_pack_cpu,
    cpu_packed_linear,
    pack_cpu_weight,
    padded_rows,
)


@given(st.integers(1, 1 << 16))
def test_padded_rows_is_close_above_and_exact_when_small(rows):
    p = padded_rows(rows)
    assert rows <= p <= rows * 17 / 16
    assert p == rows or rows > 32
    assert padded_rows(p) == p  # a padded size is its own bucket


def test_few_sizes_up_to_a_full_step():
    assert len({padded_rows(m) for m in range(1, 2049)}) == 128


@pytest.mark.skipif(
    not can_pack_cpu(torch.zeros(1, dtype=torch.bfloat16)), reason="no oneDNN bf16 packing here"
)
def test_padded_linear_gives_the_rows_asked_for():
    torch.manual_seed(0)
    w = torch.randn(96, 64).bfloat16()
    packed = pack_cpu_weight(w)
    for rows in (1, 33, 45, 100):
        x = torch.randn(rows, 64).bfloat16()
        y = cpu_packed_linear(x, packed, None)
        assert y.shape == (rows, 96) and y.is_contiguous()
        torch.testing.assert_close(y.float(), x.float() @ w.float().t(), rtol=2e-2, atol=0.1)
