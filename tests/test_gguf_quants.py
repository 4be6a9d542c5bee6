"""GGUF block decoders: bit for bit the `gguf` package's reference, on random blocks and on the
shipped files' tensors; the codes of the 4- and 5-bit types as `Int4Linear` holds them."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize as reference

from tandem.models.gguf.quants import (
    BLOCKS,
    FIVE_BIT_KINDS,
    INT4_KINDS,
    K_QUANT_KINDS,
    dequantize_rows,
    int4_rows,
    k_quant_rows,
)
from tandem.models.gguf.weights import GGUFWeights
from tandem.models.quantization.int4 import Int4Linear, KQuantScales, int4_dequantize

# Byte offsets of each block's fp16 fields (d, and dmin / m where the format has one).
_HALVES = {
    Q.Q4_0: (0,),
    Q.Q4_1: (0, 2),
    Q.Q5_0: (0,),
    Q.Q5_1: (0, 2),
    Q.Q8_0: (0,),
    Q.Q4_K: (0, 2),
    Q.Q5_K: (0, 2),
    Q.Q6_K: (208,),
}


def random_rows(kind: Q, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """[rows, bytes] of random blocks whose fp16 fields are finite (normal and subnormal, both
    signs)."""
    rng = np.random.default_rng(seed)
    size, nbytes = BLOCKS[kind]
    blocks = rng.integers(0, 256, (rows * cols // size, nbytes), dtype=np.uint8)
    for at in _HALVES[kind]:
        halves = (
            rng.standard_normal(len(blocks)) * 10.0 ** rng.integers(-7, 2, len(blocks))
        ).astype(np.float16)
        blocks[:, at : at + 2] = halves.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(rows, -1)


@pytest.mark.parametrize("kind", list(BLOCKS), ids=lambda k: k.name)
def test_decoders_match_the_reference_bit_for_bit(kind: Q) -> None:
    data = random_rows(kind, 24, 512)
    ours = dequantize_rows(data, kind)
    expected = reference(data, kind)
    assert ours.dtype == np.float32 and ours.shape == expected.shape == (24, 512)
    np.testing.assert_array_equal(ours.view(np.uint32), expected.view(np.uint32))
    # any slice of rows decodes alone, as the loader decodes a large tensor a chunk at a time
    np.testing.assert_array_equal(
        dequantize_rows(data[5:9], kind).view(np.uint32), expected[5:9].view(np.uint32)
    )


@pytest.mark.parametrize("kind", [Q.F32, Q.F16, Q.BF16], ids=lambda k: k.name)
def test_float_types_are_read_as_stored(kind: Q) -> None:
    w = np.random.default_rng(0).standard_normal((8, 64)).astype(np.float32)
    stored = {
        Q.F32: w,
        Q.F16: w.astype(np.float16),
        Q.BF16: (w.view(np.uint32) >> 16).astype(np.uint16),
    }[kind]
    ours = dequantize_rows(stored, kind)
    expected = {
        Q.F32: w,
        Q.F16: w.astype(np.float16).astype(np.float32),
        Q.BF16: ((w.view(np.uint32) >> 16) << 16).view(np.float32),
    }[kind]
    np.testing.assert_array_equal(ours, expected)


def test_an_undecodable_type_is_refused_in_words() -> None:
    with pytest.raises(ValueError, match="GGUF type Q8_1 cannot be decoded"):
        dequantize_rows(np.zeros((1, 36), np.uint8), Q.Q8_1)


@pytest.mark.parametrize("kind", INT4_KINDS, ids=lambda k: k.name)
def test_int4_codes_map_onto_the_int4_layer(kind: Q) -> None:
    """Codes are the file's (5-bit ones with their fifth bit), scale = d (d sc for the K types)
    exactly; zero = 8 scale - min is rounded once in fp32, so (q - 8) scale + zero (two roundings)
    is within a few ulp of the reference's d sc q - dmin m (one rounding), not bit-exact. In fp32
    `Int4Linear` stores scale and zero as given on its reference path (the torch-kernel path keeps
    them in the kernel's dtype, bf16 on CPU, which rounds them; the integer-activation path keeps
    fp16 d and m = zero - 8 scale, which can round). A K type's layer on the integer-activation
    path holds the file's own factors: bit for bit the reference's."""
    bits = 5 if kind in FIVE_BIT_KINDS else 4
    data = random_rows(kind, 32, 512, seed=1)
    if kind in K_QUANT_KINDS:
        codes, *factors = k_quant_rows(data, kind)
        k_quant = KQuantScales(*(torch.from_numpy(a) for a in factors))
        assert [a.dtype for a in factors] == [np.float16, np.float16, np.uint8, np.uint8]
        assert max(int(a.max()) for a in factors[2:]) == 63  # 6-bit sc and m
        scales, zeros = (t.numpy() for t in k_quant.scales_zeros())
    else:
        codes, scales, zeros = int4_rows(data, kind)
    assert codes.dtype == np.uint8 and codes.shape == (32, 512)
    assert codes.max() == (1 << bits) - 1 and codes.min() == 0  # random blocks use every code
    assert scales.shape == zeros.shape == (32, 16)
    expected = torch.from_numpy(reference(data, kind))
    if kind in K_QUANT_KINDS:
        layer = Int4Linear(torch.from_numpy(codes), k_quant, None, None, torch.float32, bits)
        if layer.int8_act:
            assert layer.sc_m is not None
            assert torch.equal(layer.dequantize().view(torch.int32), expected.view(torch.int32))
            rows = torch.tensor([0, 17, 31, 17])
            assert torch.equal(layer.rows(rows, torch.float32), expected[rows])
    got = int4_dequantize(*(torch.from_numpy(a) for a in (codes, scales, zeros)))
    # the largest term of the sum bounds the rounding error: a few ulp of it
    bound = (torch.from_numpy(scales).abs() * 24 + torch.from_numpy(zeros).abs()).repeat_interleave(
        32, 1
    )
    assert ((got - expected).abs() <= 4 * torch.finfo(torch.float32).eps * bound).all()
    if kind in (Q.Q4_0, Q.Q5_0):  # zero = 0 or -8 d: nothing is rounded
        torch.testing.assert_close(got, expected, rtol=0, atol=0)
    layer = Int4Linear(
        torch.from_numpy(codes),
        torch.from_numpy(scales),
        torch.from_numpy(zeros),
        None,
        torch.float32,
        bits,
    )
    if layer.packed is None and not layer.int8_act:  # the reference path: the same fp32 arithmetic
        assert layer.scales_zeros.dtype == torch.float32
        torch.testing.assert_close(layer.dequantize(), got, rtol=0, atol=0)
    elif layer.packed is not None:
        assert layer.scales_zeros.dtype == layer.kernel_dtype


def _real_files():
    from tandem.models.loader.model_files import gguf_source

    try:
        return {"smollm2": gguf_source("smollm2-135m"), "gemma3": gguf_source("gemma3-270m")}
    except FileNotFoundError as e:
        pytest.skip(str(e))


@pytest.mark.slow
@pytest.mark.parametrize("model", ["smollm2", "gemma3"])
def test_real_tensors_decode_as_the_reference(model: str) -> None:
    """Every tensor type of the shipped files (Q4_1; Q4_K, Q5_0, Q6_K, Q8_0, F32), a layer's worth
    of each type and the first rows of the embedding, bit for bit."""
    weights = GGUFWeights(_real_files()[model])
    seen = set()
    for name, t in weights.tensors.items():
        if t.kind in seen and "embed" not in name:
            continue
        seen.add(t.kind)
        rows = weights.raw(name, 0, 512)
        np.testing.assert_array_equal(
            dequantize_rows(rows, t.kind).view(np.uint32),
            reference(rows, t.kind).reshape(rows.shape[0], -1).view(np.uint32),
            err_msg=name,
        )
    assert seen >= ({Q.Q4_1} if model == "smollm2" else {Q.Q4_K, Q.Q5_0, Q.Q6_K, Q.Q8_0, Q.F32})
