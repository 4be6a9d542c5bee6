"""Decoders of llama.cpp's block formats: raw GGUF rows -> fp32 weights, and the codes of the 4-
and 5-bit formats as `Int4Linear` holds them.

Each decoder computes what the `gguf` package's reference (`gguf.quants.dequantize`) computes,
in the same fp32 operations and order, so the floats are bit for bit the reference's: a
block's scale times a small integer is exact in fp32 (at most 19 + 6 significant bits, rounded
once in Q6_K, as the reference rounds it); the formats with a minimum subtract it in one
rounding. They work on any slice of rows, so a large tensor is decoded a chunk at a time.

Codes (q in [0, 15] for Q4_0, Q4_1, Q4_K; in [0, 31] for Q5_0, Q5_1, Q5_K, the fifth bit
joined to the nibble), in the int4 layer's convention w = (q - 8) scale + zero:
  Q4_0 w = d (q - 8)             -> scale = d,      zero = 0
  Q4_1, Q5_1 w = d q + m         -> scale = d,      zero = m + 8 d
  Q5_0 w = d (q - 16)            -> scale = d,      zero = -8 d
  Q4_K, Q5_K w = d sc q - dmin m -> scale = d sc,   zero = 8 d sc - dmin m  (32-weight sub-blocks)
`scale` is exact in fp32 (fp16 d times a 6-bit sc); `zero` is rounded once in fp32 (exact for
Q4_0 and Q5_0), and (q - 8) scale + zero rounds again where the reference rounds once, so the
int4 layer's weights are within a few ulp of the reference's, not bit-exact
(tests/test_gguf_quants.py measures it). The K types come out as their own factors instead
(`k_quant_rows`): the integer kernel holds those, and forms d sc q - dmin m as the reference does;
elsewhere `KQuantScales.scales_zeros` maps them as in the table.
"""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize as reference_dequantize

QK_K = 256
GROUP_SIZE = 32
# (weights per block, bytes per block)
BLOCKS: dict[Q, tuple[int, int]] = {
    Q.Q4_0: (32, 18),
    Q.Q4_1: (32, 20),
    Q.Q5_0: (32, 22),
    Q.Q5_1: (32, 24),
    Q.Q8_0: (32, 34),
    Q.Q4_K: (QK_K, 144),
    Q.Q5_K: (QK_K, 176),
    Q.Q6_K: (QK_K, 210),
}
FLOATS = (Q.F32, Q.F16, Q.BF16)
FIVE_BIT_KINDS = (Q.Q5_0, Q.Q5_1, Q.Q5_K)
K_QUANT_KINDS = (Q.Q4_K, Q.Q5_K)
INT4_KINDS = (Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, *K_QUANT_KINDS)  # read by the int4 layer as they are

Int4Arrays = tuple[
    np.ndarray, np.ndarray, np.ndarray
]  # codes [N, K] uint8, scales, zeros [N, K // 32] fp32
# codes [N, K] uint8, d, dmin [N, K // 256] fp16, sc, m [N, K // 32] uint8
KQuantArrays = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]


def dequantize_rows(data: np.ndarray, kind: Q) -> np.ndarray:
    """[N, bytes per row] raw rows (fp32 / fp16 / bf16: [N, K] of that type) -> fp32 [N, K].
    Types without a decoder here go to the `gguf` package's; one it cannot decode either is
    refused naming the type."""
    if kind == Q.F32:
        return np.asarray(data).view(np.float32).reshape(data.shape[0], -1)
    if kind == Q.F16:
        return np.asarray(data).view(np.float16).reshape(data.shape[0], -1).astype(np.float32)
    if kind == Q.BF16:
        bits = np.asarray(data).view(np.uint16).reshape(data.shape[0], -1).astype(np.uint32) << 16
        return bits.view(np.float32)
    decoder = _DECODERS.get(kind)
    if decoder is None:
        try:
            return reference_dequantize(np.asarray(data), kind).reshape(data.shape[0], -1)
        except NotImplementedError as e:
            raise ValueError(f"GGUF type {kind.name} cannot be decoded") from e
    rows = data.shape[0]
    size, nbytes = BLOCKS[kind]
    blocks = np.asarray(data, dtype=np.uint8).reshape(-1, nbytes)
    return decoder(blocks).reshape(rows, -1)


def int4_rows(data: np.ndarray, kind: Q) -> Int4Arrays:
    """[N, bytes per row] raw rows of a 32-weight `INT4_KINDS` type (not a K-quant) -> codes [N,
    K] uint8 (in [0, 15], or [0, 31] for the 5-bit types), and scales, zeros [N, K // 32] fp32
    (see the module docstring)."""
    rows = data.shape[0]
    blocks = np.asarray(data, dtype=np.uint8).reshape(-1, BLOCKS[kind][1])
    d = _half(blocks, 0)
    if kind == Q.Q4_0:
        zeros, codes = np.zeros_like(d), _nibbles(blocks[:, 2:])
    elif kind == Q.Q4_1:
        zeros, codes = _half(blocks, 2) + 8 * d, _nibbles(blocks[:, 4:])
    elif kind == Q.Q5_0:
        zeros, codes = -8 * d, _nibbles(blocks[:, 6:]) | _high(blocks[:, 2:6])
    elif kind == Q.Q5_1:
        zeros, codes = _half(blocks, 2) + 8 * d, _nibbles(blocks[:, 8:]) | _high(blocks[:, 4:8])
    else:
        raise ValueError(f"int4_rows: {kind.name} is not a 32-weight 4- or 5-bit type")
    return codes.reshape(rows, -1), d.reshape(rows, -1), zeros.reshape(rows, -1)


def k_quant_rows(data: np.ndarray, kind: Q) -> KQuantArrays:
    """[N, bytes per row] raw Q4_K / Q5_K rows -> codes [N, K] uint8 (in [0, 15] / [0, 31]), d
    and dmin [N, K // 256] fp16, 6-bit sc and m [N, K // 32] uint8: w = d sc q - dmin m."""
    rows = data.shape[0]
    blocks = np.asarray(data, dtype=np.uint8).reshape(-1, BLOCKS[kind][1])
    sc, m = _k_sub_scales(blocks)
    codes = (
        _nibbles_k(blocks[:, 16:])
        if kind == Q.Q4_K
        else _nibbles_k(blocks[:, 48:]) | _high_k(blocks)
    )
    d, dmin = (
        _half(blocks, at).astype(np.float16).reshape(rows, -1) for at in (0, 2)
    )  # fp16 -> fp32 -> fp16: exact
    return codes.reshape(rows, -1), d, dmin, sc.reshape(rows, -1), m.reshape(rows, -1)


def _half(blocks: np.ndarray, at: int) -> np.ndarray:
    """The fp16 at byte `at` of every block, as fp32 [B, 1]."""
    return blocks[:, at : at + 2].copy().view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """16 bytes -> 32 codes: low nibbles are weights 0-15, high nibbles 16-31."""
    return np.concatenate([qs & 15, qs >> 4], axis=-1)


def _nibbles_k(qs: np.ndarray) -> np.ndarray:
    """A K-quant's 128 bytes of nibbles -> [B, 8, 32] codes: each 32 bytes hold sub-block 2j in
    their low nibbles and sub-block 2j + 1 in their high nibbles."""
    qs = qs.reshape(-1, 4, 1, 32)
    return np.concatenate([qs & 15, qs >> 4], axis=2).reshape(-1, 8, 32)


def _k_sub_scales(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K: the eight 6-bit scales and mins [B, 8] uint8. Bytes 4-15 pack them: scales
    0-3 and mins 0-3 in the low 6 bits of bytes 0-3 and 4-7, scales and mins 4-7 in the nibbles
    of bytes 8-11 plus those bytes' top 2 bits."""
    s = blocks[:, 4:16]
    lo, hi, mix = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    sc = np.concatenate([lo & 63, (mix & 15) | ((lo >> 6) << 4)], axis=1)
    m = np.concatenate([hi & 63, (mix >> 4) | ((hi >> 6) << 4)], axis=1)
    return sc, m


def _k_scales(blocks: np.ndarray) -> tuple[np.ndarray, ...]:
    """Q4_K / Q5_K: d, dmin [B, 1] and the sub-block scales and mins [B, 8], as fp32 [B, 8, 1]
    products' factors."""
    as_factor = lambda a: a.astype(np.float32)[..., None]  # noqa: E731
    return (
        as_factor(_half(blocks, 0)),
        as_factor(_half(blocks, 2)),
        *(as_factor(a) for a in _k_sub_scales(blocks)),
    )


def _q4_0(blocks: np.ndarray) -> np.ndarray:
    return _half(blocks, 0) * (_nibbles(blocks[:, 2:]).astype(np.float32) - 8)


def _q4_1(blocks: np.ndarray) -> np.ndarray:
    return _half(blocks, 0) * _nibbles(blocks[:, 4:]).astype(np.float32) + _half(blocks, 2)


def _high(qh: np.ndarray) -> np.ndarray:
    """A 5-bit block's 4 bytes of fifth bits (bit j: weight j's) -> [B, 32] of 0 or 16."""
    bits = qh.copy().view(np.uint32)
    return ((bits >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8) << 4


def _high_k(blocks: np.ndarray) -> np.ndarray:
    """Q5_K's 32 bytes of fifth bits after the scales -> [B, 8, 32] of 0 or 16: bit i of byte j
    is the high bit of weight j of sub-block i."""
    qh = blocks[:, 16:48].reshape(-1, 1, 32)
    return ((qh >> np.arange(8, dtype=np.uint8)[:, None]) & 1) << 4


def _q5_0(blocks: np.ndarray) -> np.ndarray:
    return _half(blocks, 0) * (
        (_nibbles(blocks[:, 6:]) | _high(blocks[:, 2:6])).astype(np.float32) - 16
    )


def _q5_1(blocks: np.ndarray) -> np.ndarray:
    return _half(blocks, 0) * (_nibbles(blocks[:, 8:]) | _high(blocks[:, 4:8])).astype(
        np.float32
    ) + _half(blocks, 2)


def _q8_0(blocks: np.ndarray) -> np.ndarray:
    return _half(blocks, 0) * blocks[:, 2:].view(np.int8).astype(np.float32)


def _q4_k(blocks: np.ndarray) -> np.ndarray:
    d, dmin, sc, m = _k_scales(blocks)
    return (d * sc) * _nibbles_k(blocks[:, 16:]).astype(np.float32) - dmin * m


def _q5_k(blocks: np.ndarray) -> np.ndarray:
    """Q4_K's layout with 32 bytes of fifth bits between the scales and the nibbles."""
    d, dmin, sc, m = _k_scales(blocks)
    return (d * sc) * (_nibbles_k(blocks[:, 48:]) | _high_k(blocks)).astype(np.float32) - dmin * m


def q8_0_rows(data: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[N, bytes per row] raw Q8_0 rows -> codes [N, K] int8 and d [N, K // 32] fp16: w = d q."""
    rows = data.shape[0]
    blocks = np.asarray(data, dtype=np.uint8).reshape(-1, BLOCKS[Q.Q8_0][1])
    return blocks[:, 2:].view(np.int8).reshape(rows, -1), blocks[:, :2].copy().view(
        np.float16
    ).reshape(rows, -1)


def q6k_rows(data: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """[N, bytes per row] raw Q6_K rows -> codes [N, K] uint8 in [0, 63], scales sc [N, K // 16]
    int8 and d [N, K // 256] fp16: w = d sc (q - 32), as `Q6KLinear` holds them."""
    rows = data.shape[0]
    blocks = np.asarray(data, dtype=np.uint8).reshape(-1, BLOCKS[Q.Q6_K][1])
    codes, sc = _q6k_codes(blocks), blocks[:, 192:208].view(np.int8)
    return (
        codes.reshape(rows, -1),
        sc.reshape(rows, -1),
        blocks[:, 208:210].copy().view(np.float16).reshape(rows, -1),
    )


def _q6k_codes(blocks: np.ndarray) -> np.ndarray:
    """Q6_K's 128 bytes of low nibbles and 64 of 2-bit highs -> [B, 256] codes in [0, 63]. Each
    half of the block (128 weights) takes 64 low-nibble bytes (weights 0-63 low, 64-127 high)
    and 32 high-bit bytes (bits 2i..2i+1 for weights 32i..32i+31)."""
    ql = blocks[:, :128].reshape(-1, 2, 1, 64)
    low = np.concatenate([ql & 15, ql >> 4], axis=2).reshape(-1, 2, 4, 32)
    qh = blocks[:, 128:192].reshape(-1, 2, 1, 32)
    high = (qh >> (2 * np.arange(4, dtype=np.uint8))[:, None]) & 3
    return (low | (high << 4)).reshape(-1, 256)


def _q6_k(blocks: np.ndarray) -> np.ndarray:
    """Codes as `_q6k_codes`, then 16 int8 scales (one per 16 weights) and fp16 d."""
    q = (_q6k_codes(blocks).astype(np.int8) - 32).reshape(-1, 16, 16).astype(np.float32)
    scales = blocks[:, 192:208].view(np.int8).astype(np.float32)
    d = _half(blocks, 208) * scales
    return d[..., None] * q


_DECODERS = {
    Q.Q4_0: _q4_0,
    Q.Q4_1: _q4_1,
    Q.Q5_0: _q5_0,
    Q.Q5_1: _q5_1,
    Q.Q8_0: _q8_0,
    Q.Q4_K: _q4_k,
    Q.Q5_K: _q5_k,
    Q.Q6_K: _q6_k,
}
