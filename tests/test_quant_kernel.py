"""The integer-activation CPU kernel (kernels/cpu_quant_gemm.cpp) behind Int4Linear / Int8Linear:
W4A8 / W8A8 against the weight-only dequantise-then-F.linear reference, its packed layouts
against the weights they came from, batch independence, and where it is (not) used."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from test_quantization import SMOLLM2_SHAPES, TINY_SHAPES

from tandem import LLM, SamplingParams
from tandem.kernels import cpu_quant_gemm
from tandem.models.layers.activation import Gate, silu_and_mul
from tandem.models.quantization.base import int8_act_kernel
from tandem.models.quantization.int4 import Int4Linear, KQuantScales, int4_dequantize, quantize_int4
from tandem.models.quantization.int8 import Int8Linear, quantize_int8
from tandem.models.quantization.q6k import Q6KLinear

pytestmark = pytest.mark.skipif(
    int8_act_kernel(torch.device("cpu"), torch.bfloat16, 16, 32) is None,
    reason="no AVX2 / AVX512-VNNI CPU or no compiler",
)

# The activations are rounded to int8 per 32 inputs: at most half a step (max|x| / 254) of each
# block's largest input; with the output's bf16 rounding (2^-9 relative) the measured worst
# over every shape below is 0.8% of the largest output. 1.5% leaves room for other seeds.
TOL = 1.5e-2


def _layers(n: int, k: int, seed: int, dtype: torch.dtype = torch.bfloat16):
    torch.manual_seed(seed)
    w, bias = torch.randn(n, k), torch.randn(n)
    codes, scales, zeros = quantize_int4(w, 32)
    q8, s8 = quantize_int8(w)
    return (
        Int4Linear(codes, scales, zeros, bias, dtype),
        Int8Linear(q8.clone(), s8, bias, dtype),
        (codes, scales, zeros),
        (q8, s8),
    )


def _rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got.float() - ref).abs().max() / ref.abs().max()).item()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", sorted(set(SMOLLM2_SHAPES + TINY_SHAPES)))
def test_kernel_equals_weight_only_reference(shape, dtype):
    n, k = shape
    int4, int8, _, _ = _layers(n, k, n + k, dtype)
    assert int4.int8_act and int8.int8_act
    for rows in (
        1,
        5,
        9,
        37,
    ):  # AVX2's 4-row and AVX-512's 8-row reads: 9 as 5 + 4, 37 as 8 x 4 + 5
        x = torch.randn(rows, k, dtype=dtype) * 3
        for layer in (int4, int8):
            ref = F.linear(x.float(), layer.dequantize(), layer.bias.float())
            assert _rel_err(layer(x), ref) < TOL, (layer, rows)


def test_packed_layouts_hold_the_weights():
    """dequantize() reads the packed tiles back: int8 exactly, int4 with d and m in fp16 (exact
    for a GGUF's own fp16 values, which these are made to be)."""
    int4, int8, (codes, scales, zeros), (q8, s8) = _layers(96, 128, 3)
    assert torch.equal(int8.dequantize(), q8.float() * s8[:, None])
    d = scales.half().float()
    m = (zeros - 8 * scales).half().float()
    exact = Int4Linear(codes, d, m + 8 * d, None, torch.bfloat16)
    torch.testing.assert_close(
        exact.dequantize(),
        codes.float() * d.repeat_interleave(32, 1) + m.repeat_interleave(32, 1),
        rtol=0,
        atol=1e-6,
    )
    torch.testing.assert_close(
        exact.dequantize(), int4_dequantize(codes, d, m + 8 * d), rtol=0, atol=1e-5
    )


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(576, 576), (1536, 576), (64, 256)])
def test_five_bit_codes_equal_the_weight_only_reference(shape, dtype):
    """5-bit codes (a GGUF's Q5 blocks): the nibble and fifth-bit planes read back exactly, the
    GEMM as the reference's; and codes of 31 against inputs of +-127 in every lane, the sums the
    AVX2 build keeps in int16 (a wrong widening would overflow them)."""
    n, k = shape
    torch.manual_seed(n + k)
    codes, scales, zeros = quantize_int4(torch.randn(n, k), 32, bits=5)
    assert codes.max() == 31
    d, m = scales.half().float(), (zeros - 8 * scales).half().float()  # exact in the kernel's fp16
    layer = Int4Linear(codes, d, m + 8 * d, torch.randn(n), dtype, bits=5)
    assert layer.int8_act and layer.qhigh.numel() == n * k // 8
    expand = lambda t: t.repeat_interleave(32, 1)  # noqa: E731
    torch.testing.assert_close(
        layer.dequantize(), codes.float() * expand(d) + expand(m), rtol=0, atol=1e-6
    )
    for rows in (1, 5, 37):
        x = torch.randn(rows, k, dtype=dtype) * 3
        ref = F.linear(x.float(), layer.dequantize(), layer.bias.float())
        assert _rel_err(layer(x), ref) < TOL, rows
        assert torch.equal(layer(x)[rows - 1], layer(x[rows - 1 :])[0])
    ones = torch.ones(n, k // 32)
    top = Int4Linear(
        torch.full((n, k), 31, dtype=torch.uint8), ones, 8 * ones, None, dtype, bits=5
    )  # w = 31
    for sign in (1, -1):
        x = torch.full((4, k), sign * 0.5, dtype=dtype)  # every input quantises to +-127
        rtol = 1e-5 if dtype == torch.float32 else 2**-8  # the output's own rounding
        torch.testing.assert_close(
            top(x).float(), torch.full((4, n), sign * 15.5 * k), rtol=rtol, atol=0
        )
    with pytest.raises(ValueError, match="a code above 15 in a layer of 4-bit codes"):
        Int4Linear(codes, scales, zeros, None, dtype)


def _q6k(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random Q6_K codes, scales (every int8, both signs) and small fp16 d, as a file holds them."""
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randint(0, 64, (n, k), generator=g, dtype=torch.uint8),
        torch.randint(-128, 128, (n, k // 16), generator=g, dtype=torch.int8),
        (torch.rand(n, k // 256, generator=g) * 1e-3 + 1e-4).half(),
    )


def _k_quant(n: int, k: int, seed: int, bits: int = 4) -> tuple[torch.Tensor, KQuantScales]:
    """Random Q4_K / Q5_K codes and factors (every 6-bit sc and m; small fp16 d and dmin), as a
    file holds them."""
    g = torch.Generator().manual_seed(seed)
    small = lambda cols: (torch.rand(n, cols, generator=g) * 1e-3 + 1e-4).half()  # noqa: E731
    six = lambda: torch.randint(0, 64, (n, k // 32), generator=g, dtype=torch.uint8)  # noqa: E731
    return torch.randint(0, 1 << bits, (n, k), generator=g, dtype=torch.uint8), KQuantScales(
        small(k // 256), small(k // 256), six(), six()
    )


def _k_quant_weights(codes: torch.Tensor, k_quant: KQuantScales) -> torch.Tensor:
    """d sc q - dmin m in gguf's fp32 order."""
    expand = lambda v: v.float().repeat_interleave(8, 1)  # noqa: E731
    per_input = lambda v: v.repeat_interleave(32, 1)  # noqa: E731
    return per_input(expand(k_quant.d) * k_quant.sc.float()) * codes.float() - per_input(
        expand(k_quant.dmin) * k_quant.m.float()
    )


def _q8_0(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random Q8_0 codes (-128 among them: a file may hold it) and fp16 d per 32, as a file holds
    them."""
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8),
        (torch.rand(n, k // 32, generator=g) * 1e-3 + 1e-4).half(),
    )


def _int8_activations(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    """x as the kernel rounds it: per `block` inputs (32, or 256 against Q4_K) q =
    round(x * 127 / max|x|) (half to even), in fp32, then back to values q * max|x| / 127, fp64."""
    blocks = x.float().reshape(x.shape[0], -1, block)
    top = blocks.abs().amax(-1, keepdim=True)
    inv = torch.where(
        top > 0, torch.full_like(top, 127) / top, torch.zeros_like(top)
    )  # not 127 / top: reciprocal * 127
    q = torch.round(blocks * inv).clamp(-127, 127)
    return (q.double() * (top / 127).double()).reshape(x.shape)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(64, 256), (576, 1536), (2048, 512)])
def test_q6_k_blocks_as_stored(shape, dtype):
    """A Q6_K layer holds the file's blocks: dequantize() is d sc (q - 32) bit for bit (the gguf
    package's order), rows() read one lane of the tiles. Its integer GEMM equals, to fp32
    rounding, the exact product of the weights with the activations as the kernel rounds them
    to int8 (so every code, scale and sub-block sum lands where it should), and the weight-only
    reference within the activations' rounding; a row does not depend on its batch."""
    n, k = shape
    codes, sc, d = _q6k(n, k, n + k)
    layer = Q6KLinear.from_codes(codes, sc, d, torch.randn(n), dtype)
    w = (d.float().repeat_interleave(16, 1) * sc.float()).repeat_interleave(16, 1) * (
        codes.float() - 32
    )
    assert torch.equal(layer.dequantize(), w)
    ids = torch.tensor([0, 17, n - 1, 5, 5])
    assert torch.equal(layer.rows(ids, torch.float32), w[ids])
    with pytest.raises(RuntimeError, match="out of range"):
        layer.rows(torch.tensor([n]), torch.float32)
    for rows in (1, 5, 37):
        x = torch.randn(rows, k, dtype=dtype) * 3
        y = layer(x).double()
        exact = _int8_activations(x) @ w.double().t() + layer.bias.double()
        tol = 1e-5 if dtype == torch.float32 else 2**-8  # fp32 sums, or the output's bf16 rounding
        torch.testing.assert_close(y, exact, rtol=tol, atol=tol * exact.abs().max().item())
        assert _rel_err(layer(x), F.linear(x.float(), w, layer.bias.float())) < TOL
        assert all(torch.equal(layer(x)[i], layer(x[i : i + 1])[0]) for i in range(rows))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_every_format_is_the_exact_product_with_its_rounded_activations(dtype):
    """int4, 5-bit, int8 (per channel and Q8_0's per block), Q6_K and K-quant tiles against the
    exact product of their weights with the activations as the kernel rounds them (per 32 inputs,
    per 256 against Q4_K), at K = 8192, with activations of mixed sign and all positive (where an
    offset added to every product and taken off late in fp32 would cancel ~1e-4 of the output),
    every row count of a tile (1-8) and one more."""
    n, k = 32, 8192
    torch.manual_seed(9)
    w = torch.randn(n, k) / 64
    codes, sc, d = _q6k(n, k, 2)
    layers = [
        Int4Linear.from_float(w, None, dtype),
        Int4Linear.from_float(w, None, dtype, bits=5),
        Int8Linear.from_float(w, None, dtype),
        Q6KLinear.from_codes(codes, sc, d, None, dtype),
        Int8Linear(*_q8_0(n, k, 3), None, dtype),
        Int4Linear(*_k_quant(n, k, 4), None, None, dtype),
        Int4Linear(*_k_quant(n, k, 5, bits=5), None, None, dtype, bits=5),
    ]
    assert all(layer.sc_m is not None for layer in layers[-2:])
    tol = 1e-5 if dtype == torch.float32 else 2**-8  # fp32 sums, or the output's bf16 rounding
    for layer in layers:
        weights = layer.dequantize().double()
        for rows in range(1, 10):
            for x in (torch.randn(rows, k), torch.randn(rows, k).abs() + 2):
                x = x.to(dtype)
                q4_k = getattr(layer, "sc_m", None) is not None and layer.qhigh is None
                exact = _int8_activations(x, 256 if q4_k else 32) @ weights.t()
                torch.testing.assert_close(
                    layer(x).double(),
                    exact,
                    rtol=tol,
                    atol=tol * exact.abs().max().item(),
                    # called inside assert_close, while layer and rows are this iteration's
                    msg=lambda m: f"{type(layer).__name__} rows={rows}: {m}",  # noqa: B023
                )


def test_q8_0_blocks_as_stored():
    """int8 with an fp16 d per 32 (a GGUF Q8_0 tensor) holds the file's codes and d: dequantize()
    is d q bit for bit, rows() one lane of the tiles (with a scale per row too); codes of -128
    (|q| = 128, which AVX2's sign trick on x could not negate) against inputs of +-127 in every
    lane; the fused SiLU-and-mul; refused off the integer kernel."""
    n, k = 48, 256
    q, d = _q8_0(n, k, 4)
    layer = Int8Linear(q.clone(), d, None, torch.float32)
    w = q.float() * d.float().repeat_interleave(32, 1)
    assert layer.blocked and torch.equal(layer.dequantize(), w)
    ids = torch.tensor([0, 17, n - 1, 5, 5])
    assert torch.equal(layer.rows(ids, torch.float32), w[ids])
    with pytest.raises(RuntimeError, match="out of range"):
        layer.rows(torch.tensor([-1]), torch.float32)
    scales = torch.rand(n) + 0.5  # one fp32 scale per row (int8 from float weights)
    per_row = Int8Linear(q.clone(), scales, None, torch.float32)
    assert not per_row.blocked and torch.equal(
        per_row.rows(ids, torch.float32), q[ids].float() * scales[ids, None]
    )
    low = Int8Linear(
        torch.full((n, k), -128, dtype=torch.int8),
        torch.ones(n, k // 32, dtype=torch.float16),
        None,
        torch.float32,
    )
    for sign in (1, -1):
        x = torch.full((4, k), sign * 0.5)  # every input quantises to +-127
        torch.testing.assert_close(low(x), torch.full((4, n), -sign * 64.0 * k), rtol=1e-6, atol=0)
    x = torch.randn(9, k)
    fused = layer.forward_gated(x, Gate.SILU)
    torch.testing.assert_close(fused, silu_and_mul(layer(x)), rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="integer kernel only"):
        Int8Linear(q[:40].clone(), d[:40], None, torch.float32)  # 40 rows: no tiles of 16


def test_q6_k_extremes_and_parts():
    """Codes of 0 and 63 with scales of -128 and 127 against inputs of +-127 in every lane (the
    AVX2 build's int16 pair sums and int32 scaling at their largest); a layer loaded a slice of
    rows at a time, or from parts, holds the tiles the whole one does; the fused SiLU-and-mul."""
    n, k = 32, 512
    for code, scale in ((63, 127), (0, -128), (63, -128)):
        layer = Q6KLinear.from_codes(
            torch.full((n, k), code, dtype=torch.uint8),
            torch.full((n, k // 16), scale, dtype=torch.int8),
            torch.ones(n, k // 256, dtype=torch.float16),
            None,
            torch.float32,
        )
        for sign in (1, -1):
            x = torch.full((4, k), sign * 0.5)  # every input quantises to +-127
            torch.testing.assert_close(
                layer(x),
                torch.full((4, n), sign * 0.5 * k * scale * (code - 32)),
                rtol=1e-6,
                atol=0,
            )
    codes, sc, d = _q6k(96, 512, 1)
    whole = Q6KLinear.from_codes(codes, sc, d, None, torch.float32)
    sliced = Q6KLinear(96, 512, None, torch.float32, torch.device("cpu"))
    for start in (64, 0, 32):
        sliced.load(start, codes[start : start + 32], sc[start : start + 32], d[start : start + 32])
    for name in ("qpacked", "qtop", "sc", "d"):
        assert torch.equal(getattr(sliced, name), getattr(whole, name)), name
    with pytest.raises(ValueError, match="whole tiles of 16"):
        sliced.load(8, codes[:16], sc[:16], d[:16])
    with pytest.raises(ValueError, match="a code above 63"):
        sliced.load(0, codes[:16] + 64, sc[:16], d[:16])
    x = torch.randn(9, 512)
    fused = whole.forward_gated(x, Gate.SILU)
    torch.testing.assert_close(fused, silu_and_mul(whole(x)), rtol=1e-6, atol=1e-6)
    assert all(
        torch.equal(fused[i], whole.forward_gated(x[i : i + 1], Gate.SILU)[0]) for i in range(9)
    )


def test_a_layer_packed_part_by_part_equals_the_layer_packed_whole():
    """Int4Linear.concat (a fused qkv loaded one part at a time) holds the same tiles, and so
    computes the same outputs, as the layer built from the concatenated codes."""
    torch.manual_seed(5)
    parts = [quantize_int4(torch.randn(n, 128), 32) for n in (64, 32, 32)]
    bias = torch.randn(128)
    whole = Int4Linear(*(torch.cat([p[i] for p in parts]) for i in range(3)), bias, torch.float32)
    joined = Int4Linear.concat(
        [Int4Linear(*p, None, torch.float32) for p in parts], bias, torch.float32
    )
    for name in ("qpacked", "d", "m", "bias"):
        assert torch.equal(getattr(joined, name), getattr(whole, name)), name
    x = torch.randn(5, 128)
    assert joined.out_features == 128 and torch.equal(joined(x), whole(x))
    with pytest.raises(ValueError, match="16 rows"):
        Int4Linear.concat(
            [Int4Linear(*quantize_int4(torch.randn(8, 128), 32), None, torch.float32)] * 2,
            None,
            torch.float32,
        )
    # 5-bit layers: a part of 4-bit codes joins as 5-bit codes; a layer of mixed widths is refused
    five = [quantize_int4(torch.randn(32, 128), 32, bits=5), parts[1]]
    whole = Int4Linear(
        *(torch.cat([p[i] for p in five]) for i in range(3)), None, torch.float32, bits=5
    )
    joined = Int4Linear.concat(
        [Int4Linear(*p, None, torch.float32, bits=5) for p in five], None, torch.float32
    )
    for name in ("qpacked", "qhigh", "d", "m"):
        assert torch.equal(getattr(joined, name), getattr(whole, name)), name
    with pytest.raises(ValueError, match="one width"):
        Int4Linear.concat(
            [
                Int4Linear(*five[0], None, torch.float32, bits=5),
                Int4Linear(*parts[1], None, torch.float32),
            ],
            None,
            torch.float32,
        )


@pytest.mark.parametrize("bits", [4, 5])
def test_k_quant_factors_as_stored(bits):
    """A K-quant layer (GGUF Q4_K / Q5_K) holds the file's factors: dequantize() and rows() are
    d sc q - dmin m bit for bit; sc and m of 63 with the largest codes against inputs of +-127
    in every lane; parts join (as K-quant factors, or as fp16 d and m beside a part that holds
    those) into the layer the whole would be; the fused SiLU-and-mul."""
    n, k = 96, 512
    codes, k_quant = _k_quant(n, k, 6, bits)
    layer = Int4Linear(codes, k_quant, None, torch.randn(n), torch.float32, bits)
    w = _k_quant_weights(codes, k_quant)
    assert layer.sc_m.dtype == torch.uint8 and layer.m is None
    assert torch.equal(layer.dequantize().view(torch.int32), w.view(torch.int32))
    ids = torch.tensor([0, 17, n - 1, 5, 5])
    assert torch.equal(layer.rows(ids, torch.float32), w[ids])
    x = torch.randn(9, k)
    exact = _int8_activations(x, 256 if bits == 4 else 32) @ w.double().t() + layer.bias.double()
    torch.testing.assert_close(
        layer(x).double(), exact, rtol=1e-5, atol=1e-5 * exact.abs().max().item()
    )
    top = (1 << bits) - 1
    ones = torch.ones(32, k // 256, dtype=torch.float16)
    full = torch.full((32, k // 32), 63, dtype=torch.uint8)
    extreme = Int4Linear(
        torch.full((32, k), top, dtype=torch.uint8),
        KQuantScales(ones, ones, full, full),
        None,
        None,
        torch.float32,
        bits,
    )
    for sign in (1, -1):
        full_x = torch.full((4, k), sign * 0.5)  # every input quantises to +-127
        torch.testing.assert_close(
            extreme(full_x), torch.full((4, 32), sign * 0.5 * k * 63 * (top - 1)), rtol=1e-6, atol=0
        )
    parts = [
        (codes[:64], KQuantScales(*(v[:64] for v in k_quant))),
        (codes[64:], KQuantScales(*(v[64:] for v in k_quant))),
    ]
    joined = Int4Linear.concat(
        [Int4Linear(*p, None, None, torch.float32, bits) for p in parts], layer.bias, torch.float32
    )
    for name in ("qpacked", "qhigh", "d", "sc_m"):
        assert (getattr(joined, name) is None) == (bits == 4 and name == "qhigh"), name
        assert getattr(joined, name) is None or torch.equal(
            getattr(joined, name), getattr(layer, name)
        ), name
    assert torch.equal(joined(x), layer(x))
    plain = quantize_int4(torch.randn(32, k), 32, bits)
    mixed = Int4Linear.concat(
        [
            Int4Linear(*parts[0], None, None, torch.float32, bits),
            Int4Linear(*plain, None, torch.float32, bits),
        ],
        None,
        torch.float32,
    )
    assert mixed.sc_m is None and mixed.d.shape == (6, k // 32, 16)
    expand = lambda v: v.float().repeat_interleave(8, 1)  # noqa: E731
    d16, m16 = (
        (expand(f) * v.float())[:64].half().float().repeat_interleave(32, 1)
        for f, v in ((k_quant.d, k_quant.sc), (-k_quant.dmin.float(), k_quant.m))
    )
    assert torch.equal(
        mixed.dequantize()[:64], codes[:64].float() * d16 + m16
    )  # d sc and -dmin m rounded to fp16
    fused = layer.forward_gated(
        x, Gate.SILU
    )  # 9 rows: two reads, the second on the scales the first kept
    torch.testing.assert_close(fused, silu_and_mul(layer(x)), rtol=1e-6, atol=1e-6)
    assert all(
        torch.equal(fused[i], layer.forward_gated(x[i : i + 1], Gate.SILU)[0]) for i in range(9)
    )


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_row_does_not_depend_on_its_batch(dtype):
    int4, int8, _, _ = _layers(576, 1536, 4, dtype)
    x = torch.randn(11, 1536, dtype=dtype)
    for layer in (int4, int8):
        batched = layer(x)
        assert all(torch.equal(batched[i], layer(x[i : i + 1])[0]) for i in range(11))
        assert torch.equal(layer(x.reshape(1, 11, 1536))[0], batched)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(
    "shape", [(3072, 576), (256, 64)]
)  # SmolLM2's and the tiny models' gate_up
@pytest.mark.parametrize("gate", list(Gate), ids=lambda g: g.name.lower())
def test_fused_gate_equals_the_separate_ops(shape, dtype, gate):
    """The gate_up GEMM's epilogue rounds where GEMM -> act -> mul round, in torch's formulas; only
    its exp (and the tanh made from it) differ from torch's, so a bf16 value may move by one step
    (2^-8) of itself, an fp32 one by a few ulps (more where gelu-tanh's 1 + tanh cancels). Rows stay
    independent, at prefill sizes too."""
    n, k = shape
    torch.manual_seed(n)
    w = torch.randn(n, k) / k**0.5
    for layer in (
        Int4Linear.from_float(w, None, dtype),
        Int4Linear.from_float(w, None, dtype, bits=5),
        Int8Linear.from_float(w, None, dtype),
    ):
        x = torch.randn(9, k, dtype=dtype) * 3
        fused, separate = layer.forward_gated(x, gate), gate(layer(x))
        assert layer.int8_act and torch.equal(
            fused, cpu_quant_gemm().gemm(x, layer.gemm_weights, gate)
        )  # the epilogue's
        assert fused.shape == (9, n // 2)
        if dtype == torch.bfloat16:
            torch.testing.assert_close(fused.float(), separate.float(), rtol=2**-7, atol=1e-5)
            assert (fused == separate).float().mean() > 0.99
        else:
            torch.testing.assert_close(fused, separate, rtol=1e-6, atol=1e-6)
        assert all(
            torch.equal(fused[i], layer.forward_gated(x[i : i + 1], gate)[0]) for i in range(9)
        )
        many = torch.randn(
            2100, k, dtype=dtype
        )  # prefill-sized: a few tiles of gate, then of up, at a time
        assert torch.equal(
            layer.forward_gated(many, gate)[-9:], layer.forward_gated(many[-9:], gate)
        )
    with_bias = Int4Linear.from_float(
        w, torch.randn(n), torch.bfloat16
    )  # not fused: the bias comes first
    x = torch.randn(3, k, dtype=torch.bfloat16)
    assert torch.equal(with_bias.forward_gated(x, gate), gate(with_bias(x)))


def test_the_kernel_refuses_an_unknown_gate():
    layer = Int8Linear.from_float(torch.randn(32, 64), None, torch.float32)
    with pytest.raises(RuntimeError, match="gate 0 \\(none\\), 1 \\(SiLU\\) or 2"):
        cpu_quant_gemm().gemm(torch.randn(2, 64), layer.gemm_weights, 3)


def test_where_the_kernel_is_not_used():
    """Shapes the tiles do not fit, fp16 activations and int4 groups other than 32 take
    torch's kernels or the reference path."""
    torch.manual_seed(5)
    w = torch.randn(40, 64)  # N % 16 != 0
    assert not Int4Linear.from_float(w, None, torch.bfloat16).int8_act
    assert not Int8Linear.from_float(w, None, torch.bfloat16).int8_act
    w = torch.randn(64, 64)
    assert not Int4Linear.from_float(w, None, torch.float16).int8_act
    assert not Int8Linear.from_float(w, None, torch.float16).int8_act
    assert not Int4Linear.from_float(w, None, torch.bfloat16, group_size=64).int8_act
    assert int8_act_kernel(torch.device("meta"), torch.bfloat16, 64, 64) is None


@pytest.mark.parametrize("precision", ["int8", "int4"])
def test_bf16_quantised_engine_is_batch_independent(tmp_path, precision):
    """In the deterministic mode, which keeps this kernel as it is, greedy tokens of a request
    are the same batched with others and run alone (head_dim 64: the paged attention kernel;
    without the mode bf16 attention and GEMMs round by batch shape, and ties on a random model
    flip)."""
    import transformers as tf
    from conftest import TINY, random_prompts, token_ids, write_tiny_model

    config = tf.LlamaConfig(
        **{**TINY, "hidden_size": 128, "num_attention_heads": 2, "num_key_value_heads": 1},
        tie_word_embeddings=True,
    )
    path = write_tiny_model(config, tmp_path)
    prompts = random_prompts(8, 6, 3, 40)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    llm = LLM(
        path, dtype="bfloat16", kv_cache_memory=1 << 22, quantization=precision, deterministic=True
    )
    assert any(
        getattr(m, "int8_act", False)
        for m in llm.engine.core.executor.variants.models[precision].modules()
    )
    batched = token_ids(llm.generate(prompts, params))
    alone = [llm.generate([p], params)[0].outputs[0].token_ids for p in prompts]
    assert batched == alone


@pytest.mark.slow
def test_smollm2_int4_tiles_hold_the_gguf_q4_1_weights():
    """The kernel's fp16 d / m tiles keep the default model's Q4_1 weights exactly: each layer
    dequantises to the gguf package's dequantisation (which the float variants load)."""
    from tandem.models.gguf.weights import GGUFWeights
    from tandem.models.loader.model_files import gguf_source

    weights = GGUFWeights(gguf_source("smollm2-135m"))
    for name in weights.names():
        codes = weights.int4(name)
        if codes is not None:
            assert torch.equal(
                Int4Linear(*codes, None, torch.bfloat16).dequantize(), weights.get(name)
            ), name


def test_the_build_is_the_one_asked_for():
    """TANDEM_CPU_ISA=avx2 builds the AVX2 kernel (what an AVX2-only CPU runs) on any CPU."""
    assert cpu_quant_gemm().vector_bits == (512 if _avx512_build() else 256)


def _avx512_build() -> bool:
    """Whether the native build here is the AVX-512 one (it needs BW, VNNI and BF16)."""
    if os.environ.get("TANDEM_CPU_ISA") == "avx2" or not Path("/proc/cpuinfo").exists():
        return False
    text = Path("/proc/cpuinfo").read_text()
    flags = next(
        (line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")),
        [],
    )
    return {"avx512bw", "avx512_vnni", "avx512_bf16"} <= set(flags)


@pytest.mark.slow
@pytest.mark.skipif(not _avx512_build(), reason="the native build here is the AVX2 one already")
def test_the_avx2_build_passes_these_tests_too():
    """On an AVX-512 CPU the AVX2 build runs this file's kernel tests as well (built once into the
    shared cache): CI on either kind of machine checks the build an AVX2-only CPU serves with."""
    tests = (
        "reference or five_bit or packed or batch or silu or fused_gate or unknown_gate "
        "or asked_for or q6_k or q8_0 or exact"
    )
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-p",
            "no:xdist",
            __file__,
            "-k",
            tests,
        ],
        env={**os.environ, "TANDEM_CPU_ISA": "avx2"},
        capture_output=True,
        text=True,
        timeout=900,
        cwd=Path(__file__).parent,
    )
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert " passed" in run.stdout and "skipped" not in run.stdout.splitlines()[-1], run.stdout[
        -1000:
    ]


def test_k_quant_parts_of_odd_rows_join_as_factors():
    """A fused layer whose K-quant parts are not whole tiles of 16 (packed after joining) keeps
    the parts' own factors, as a layer packed part by part does."""
    from tandem.models.loader.stored_layers import _int4_linear

    k = 512
    parts = {"a": _k_quant(24, k, 7), "b": _k_quant(8, k, 8)}

    class Source:  # the two methods of GGUFWeights the int4 builder reads, and the shapes
        def code_bits(self, name):
            return 4

        def shape(self, name):
            return tuple(parts[name][0].shape)

        def int4(self, name):
            return parts[name][0], parts[name][1], None

    layer, native = _int4_linear(Source(), ["a", "b"], None, torch.float32, torch.device("cpu"))
    assert native == 2 and layer.sc_m is not None
    w = torch.cat([_k_quant_weights(*parts[name]) for name in ("a", "b")])
    assert torch.equal(layer.dequantize(), w)
