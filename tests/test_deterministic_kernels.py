"""The deterministic mode's kernels compute a row the same way whatever else is in the call: the
batch-invariant GEMM bit for bit at every row count and offset, the quantised layers' kernels it
keeps likewise; and the mode is refused in words where it cannot be honoured."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from tandem.config import EngineConfig, load_yaml
from tandem.executor.input_batch import InputBuilder
from tandem.kernels import cpu_invariant_gemm
from tandem.models.layers.batch_invariant import InvariantLinear, check_supported
from tandem.models.quantization.int4 import Int4Linear
from tandem.models.quantization.int8 import Int8Linear

pytestmark = pytest.mark.skipif(
    cpu_invariant_gemm() is None, reason="no C++ toolchain for the native kernel"
)
DTYPES = st.sampled_from([torch.float32, torch.bfloat16])


@settings(max_examples=25, deadline=None)
@given(
    n=st.integers(1, 80),
    k=st.integers(1, 96),
    m=st.integers(1, 40),
    dtype=DTYPES,
    bias=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_a_row_is_bit_equal_whatever_the_row_count(n, k, m, dtype, bias, seed):
    g = torch.Generator().manual_seed(seed)
    w, b = torch.randn(n, k, generator=g).to(dtype), torch.randn(n, generator=g) if bias else None
    x = torch.randn(m + 7, k, generator=g).to(dtype)
    layer = InvariantLinear(w, b)
    full = layer(x)
    assert full.dtype == dtype and full.shape == (m + 7, n)
    for start, rows in ((0, 1), (m // 2, 1), (3, m), (0, m + 7), (m + 6, 1)):
        assert torch.equal(layer(x[start : start + rows]), full[start : start + rows])
    ref = F.linear(x.float(), w.float(), None if b is None else b.float())
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(full.float(), ref, rtol=tol, atol=tol * (k**0.5))


def test_the_thread_count_does_not_change_a_row():
    torch.manual_seed(0)
    layer, x = InvariantLinear(torch.randn(200, 64), None), torch.randn(9, 64)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = layer(x)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, layer(x))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cls", [Int8Linear, Int4Linear])
def test_the_quantised_kernels_kept_are_row_invariant(cls, dtype):
    torch.manual_seed(0)
    layer = cls.from_float(torch.randn(96, 128), None, dtype)
    x = torch.randn(70, 128).to(dtype)
    full = layer(x)
    for m in (1, 2, 5, 16, 33, 64):
        for start in (0, 6):
            assert torch.equal(layer(x[start : start + m]), full[start : start + m])


def test_refused_in_words_where_it_cannot_be_honoured(monkeypatch):
    with pytest.raises(ValueError, match="CPU only"):
        check_supported(torch.device("cuda"), torch.bfloat16)
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        check_supported(torch.device("cpu"), torch.float16)
    with pytest.raises(ValueError, match="head_dim 64 or 128"):
        InputBuilder(16, torch.device("cpu"), "torch", 16, deterministic=True)
    with pytest.raises(ValueError, match="true or false"):
        EngineConfig.from_kwargs(deterministic="yes")


def test_yaml_serving_deterministic(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("serving:\n  deterministic: true\n")
    assert EngineConfig.from_kwargs(**load_yaml(path)).device_config.deterministic is True
