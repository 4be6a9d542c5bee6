"""int4 weights in groups along the input axis, with a scale and a zero point.

int4 codes q in [0, 15] mean w = (q - 8) * scale + zero, the convention of both int4 kernels;
a GGUF Q4_1 block (w = d * q + m) is scale = d, zero = m + 8 d, and Q4_0 (w = d (q - 8)) is
scale = d, zero = 0, so either loads without requantising. The int4 layer also holds 5-bit
codes (q in [0, 31], same convention): GGUF's Q5 blocks as they are (with a fused layer's other
parts, whose codes then fit 5 bits too). Only the integer kernel and the reference path read them.
"""

from __future__ import annotations

import logging
from typing import NamedTuple

import torch
import torch.nn.functional as F

from tandem.kernels import cpu_quant_gemm
from tandem.models.quantization import base
from tandem.models.quantization.base import (
    IntegerKernelLayer,
    block_tiles,
    int8_act_forward,
    kernel_accepts,
    kernel_dtype,
)

log = logging.getLogger(__name__)

INT4_GROUP_SIZES = (32, 64, 128, 256)
DEFAULT_INT4_GROUP = 32


class KQuantScales(NamedTuple):
    """A GGUF K-quant's (Q4_K, Q5_K) factors as the file stores them, w = d sc q - dmin m: fp16 d
    and dmin [N, K // 256], 6-bit sc and m [N, K // 32] uint8."""

    d: torch.Tensor
    dmin: torch.Tensor
    sc: torch.Tensor
    m: torch.Tensor

    def scales_zeros(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The int4 convention's fp32 scale = d sc (exact) and zero = 8 scale - dmin m (rounded
        once)."""
        per_block = lambda v: v.float().repeat_interleave(8, 1)  # noqa: E731
        scales = per_block(self.d) * self.sc.float()
        return scales, 8 * scales - per_block(self.dmin) * self.m.float()

    def to(self, device: torch.device) -> KQuantScales:
        return KQuantScales(*(t.to(device) for t in self))


class Int4Linear(IntegerKernelLayer):
    """y = x W^T + b with W[n, k] = (q[n, k] - 8) * scale[n, k // g] + zero[n, k // g], q of
    `bits` bits (4, or 5 for a GGUF's 5-bit blocks)."""

    def __init__(
        self,
        codes: torch.Tensor,
        scales: torch.Tensor | KQuantScales,
        zeros: torch.Tensor | None,
        bias: torch.Tensor | None,
        dtype: torch.dtype,
        bits: int = 4,
    ) -> None:
        """codes: [N, K] integers in [0, 2^bits - 1]; scales, zeros: [N, K // group]; or scales a
        K-quant's factors (zeros None), which the integer kernel holds as they are: u8 sc and m per
        32 inputs and fp16 d and dmin per 256, 4.625 bits a weight where fp16 d and m per 32 take 5
        (which also rounds d sc), dequantising there bit for bit as gguf does; elsewhere they become
        scale and zero (within a few ulp)."""
        super().__init__()
        k_quant = scales if isinstance(scales, KQuantScales) else None
        if k_quant is not None:
            if codes.shape[1] % 256:
                raise ValueError(f"int4: K-quant factors need K % 256 == 0, not K={codes.shape[1]}")
            scales = zeros = (
                None  # formed below only where the integer kernel does not serve the layer
            )
        if bits not in (4, 5):
            raise ValueError(f"int4: codes of {bits} bits (4 or 5 are held)")
        if codes.numel() and int(codes.max()) >> bits:
            raise ValueError(f"int4: a code above {(1 << bits) - 1} in a layer of {bits}-bit codes")
        self.bits = bits
        self.out_features, self.in_features = codes.shape
        groups = (k_quant.sc if k_quant is not None else scales).shape[1]
        self.group_size = self.in_features // groups
        if self.group_size * groups != self.in_features:
            raise ValueError(f"int4: {groups} groups do not divide K={self.in_features}")
        self.register_buffer("bias", None if bias is None else bias.to(dtype))
        ext = (
            base.int8_act_kernel(codes.device, dtype, *codes.shape)
            if self.group_size == 32
            else None
        )
        self.int8_act = ext is not None
        if self.int8_act:
            self.register_buffer("qpacked", ext.pack_int4(codes))
            self.register_buffer("qhigh", ext.pack_high_bits(codes) if bits == 5 else None)
            if (
                k_quant is not None
            ):  # d and -dmin [N/16, K/256, 2, 16] fp16, sc and m [N/16, K/32, 2, 16] uint8
                self.register_buffer(
                    "d",
                    torch.stack([block_tiles(k_quant.d), block_tiles(-k_quant.dmin.float())], 2),
                )
                self.register_buffer("m", None)
                self.register_buffer(
                    "sc_m",
                    torch.stack(
                        [block_tiles(k_quant.sc, torch.uint8), block_tiles(k_quant.m, torch.uint8)],
                        2,
                    ),
                )
            else:  # fp16 d and m (w = d q + m) in [N/16, K/32, 16] tiles: a GGUF's own values
                self.register_buffer("d", block_tiles(scales))
                self.register_buffer("m", block_tiles(zeros.float() - 8 * scales.float()))
                self.register_buffer("sc_m", None)
            self._view_tables()
            self.packed = self.codes = None
            return
        if k_quant is not None:
            scales, zeros = k_quant.scales_zeros()
        self.kernel_dtype = kernel_dtype(codes.device, dtype)
        # [K // g, N, 2] in the kernel's dtype: the layout (and dtype) both kernels read.
        scales_zeros = torch.stack([scales.t(), zeros.t()], -1).contiguous()
        self.register_buffer("scales_zeros", scales_zeros.to(self.kernel_dtype))
        self.packed = _pack_int4(codes, dtype) if bits == 4 else None  # torch's kernels take 4 bits
        if self.packed is not None and not kernel_accepts(
            self._kernel, self.in_features, self.kernel_dtype, codes.device, "int4"
        ):
            self.packed = None
        if self.packed is None:  # the reference path dequantises in the activation dtype
            self.scales_zeros = scales_zeros.to(dtype)
        # The reference path keeps 4-bit codes two to a byte (even k in the low nibble), 5-bit ones
        # a byte each.
        self.codes = None
        if self.packed is None:
            self.codes = (codes[:, ::2] | (codes[:, 1::2] << 4) if bits == 4 else codes).to(
                torch.uint8
            )

    @classmethod
    def from_float(
        cls,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        dtype: torch.dtype,
        group_size: int = DEFAULT_INT4_GROUP,
        bits: int = 4,
    ) -> Int4Linear:
        return cls(*quantize_int4(weight, group_size, bits), bias, dtype, bits)

    @classmethod
    def concat(
        cls, parts: list[Int4Linear], bias: torch.Tensor | None, dtype: torch.dtype
    ) -> Int4Linear:
        """One layer of the row parts (a fused qkv or gate_up), each already packed for the
        integer kernel with a multiple of 16 rows: built part by part, loading holds one part's
        one-byte codes rather than the whole layer's beside their concatenation. Takes over the
        first part."""
        layer = parts[0]
        if not all(p.int8_act and p.out_features % 16 == 0 and p.bits == layer.bits for p in parts):
            raise ValueError(
                "int4: only parts packed for the integer kernel, 16 rows at a time, "
                "with codes of one width, concatenate"
            )
        if len({p.sc_m is None for p in parts}) > 1:
            for p in parts:
                p._unfactor()
        if len(parts) > 1:
            layer.out_features = sum(p.out_features for p in parts)
            for name in ("qpacked", "qhigh", "d", "m", "sc_m"):
                if getattr(layer, name) is not None:
                    setattr(layer, name, torch.cat([getattr(p, name) for p in parts]))
            layer._view_tables()
        layer.bias = None if bias is None else bias.to(dtype)
        return layer

    def _kernel(self, x2d: torch.Tensor) -> torch.Tensor:
        if self.packed.device.type == "cuda":
            return torch._weight_int4pack_mm(x2d, self.packed, self.group_size, self.scales_zeros)
        y = torch._weight_int4pack_mm_for_cpu(
            x2d.to(self.kernel_dtype), self.packed, self.group_size, self.scales_zeros
        )
        return y.to(x2d.dtype)

    def _block_scales(
        self, tiles: torch.Tensor, lane: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The integer kernel's d and m (w = d q + m) of packed tiles `tiles`, fp32 [tiles, K/32,
        16], or of one column `lane` of each [tiles, K/32]: a K-quant's formed as the kernel forms
        them, d sc and -dmin m."""
        pick = (
            (lambda v: v[tiles].float())
            if lane is None
            else (lambda v: v[tiles, ..., lane].float())
        )  # noqa: E731
        if self.sc_m is None:
            return pick(self.d), pick(self.m)
        d_m = pick(self.d).repeat_interleave(8, 1) * pick(
            self.sc_m
        )  # (d, -dmin) times (sc, m) on axis 2
        return d_m[:, :, 0], d_m[:, :, 1]

    def _unfactor(self) -> None:
        """Hold a K-quant's scales as fp16 d and m per block (to join parts that hold those)."""
        if self.sc_m is not None:
            self.d, self.m = (
                v.half() for v in self._block_scales(torch.arange(self.out_features // 16))
            )
            self.sc_m = None
            self._view_tables()

    def _view_tables(self) -> None:
        """The integer kernel's view of the tables (`gemm_weights`), made again wherever one is
        replaced: it holds the tensors it was given."""
        self.gemm_weights = [
            cpu_quant_gemm().int4_weight(
                self.qpacked, self.d, self.m, self.out_features, self.qhigh, self.sc_m
            )
        ]

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """On the integer-activation and reference paths (torch's packed layouts are its own)."""
        if self.int8_act:
            tiles = torch.arange(self.out_features // 16)
            codes = self._tile_codes(tiles).permute(0, 4, 1, 2, 3, 5).reshape(self.out_features, -1)

            def untile(t: torch.Tensor) -> torch.Tensor:
                return t.transpose(1, 2).reshape(self.out_features, -1).repeat_interleave(32, 1)

            d, m = self._block_scales(tiles)
            return (codes.float() * untile(d) + untile(m)).to(dtype)
        codes = self.codes
        if self.bits == 4:
            codes = torch.stack([codes & 15, codes >> 4], -1).reshape(self.out_features, -1)
        return int4_dequantize(
            codes, self.scales_zeros[..., 0].t(), self.scales_zeros[..., 1].t()
        ).to(dtype)

    def rows(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows `ids` of W, dequantised as `dequantize` does: an embedding lookup in this table
        (a GGUF vocabulary stored in 4- or 5-bit blocks; the builder keeps such a table only on
        the integer kernel's tiles)."""
        if not self.int8_act:
            raise ValueError("int4: rows are read from the integer kernel's tiles only")
        t, lane = ids // 16, ids % 16  # row r is lane r % 16 of tile r // 16
        p = self.qpacked.view(-1, self.in_features // 32, 4, 16, 4)[
            t, :, :, lane
        ]  # [ids, K/32, 4 (j), 4 (i)]
        codes = torch.stack([p & 15, p >> 4], 2)
        if self.bits == 5:
            codes = codes | (self._fifth_bits(t)[torch.arange(len(ids)), :, :, :, lane] << 4)
        d, m = (v.repeat_interleave(32, 1) for v in self._block_scales(t, lane))
        return (codes.reshape(len(ids), -1).float() * d + m).to(dtype)

    def _tile_codes(self, tiles: torch.Tensor) -> torch.Tensor:
        """The codes of packed tiles `tiles` as [tiles, K/32, 2 (nibble), 4 (j), 16 (n), 4 (i)]:
        input 16 nibble + 4 j + i of column n (the layout in cpu_quant_gemm.cpp)."""
        p = self.qpacked.view(-1, self.in_features // 32, 4, 16, 4)[tiles]
        codes = torch.stack([p & 15, p >> 4], 2)
        return codes | (self._fifth_bits(tiles) << 4) if self.bits == 5 else codes

    def _fifth_bits(self, tiles: torch.Tensor) -> torch.Tensor:
        """The 5-bit codes' fifth bits of packed tiles `tiles` as [tiles, K/32, 2 (nibble), 4 (j),
        16 (n), 4 (i)], from the plane in the layout of the kernel build that packed it."""
        plane = self.qhigh.view(-1, self.in_features // 32, 2, 32, 1)[tiles]
        bits = (plane >> torch.arange(8, dtype=torch.uint8)) & 1
        if cpu_quant_gemm().vector_bits == 512:  # [j][nibble][64 bits, bit 4n + i]
            return bits.reshape(-1, self.in_features // 32, 4, 2, 16, 4).transpose(2, 3)
        # AVX2: [group j // 2][byte 4n' + i] of bit 4 (j % 2) + 2 nibble + h, column n = 8h + n'
        bits = bits.reshape(-1, self.in_features // 32, 2, 8, 4, 8).permute(
            0, 1, 2, 5, 3, 4
        )  # [g, bit, n', i]
        bits = bits.reshape(-1, self.in_features // 32, 4, 2, 2, 8, 4)  # [j, nibble, h, n', i]
        return bits.transpose(2, 3).reshape(-1, self.in_features // 32, 2, 4, 16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.int8_act:
            return int8_act_forward(self, x)
        if self.packed is None:
            return F.linear(x, self.dequantize(x.dtype), self.bias)
        y = self._kernel(x.reshape(-1, self.in_features)).reshape(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias


def quantize_int4(
    weight: torch.Tensor, group_size: int, bits: int = 4, rows_per_chunk: int = 1024
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric per group of `group_size` inputs (as GGUF Q4_1; Q5_1 with bits=5): codes [N, K],
    scales and zeros [N, K // g]. A chunk of rows at a time: each row's groups are its own, and the
    fp32 temporaries of a whole layer (a 1B model's 8192 x 2048 down_proj: 64 MiB each) set the
    peak of loading a file whose 6-bit layers are requantised."""
    n, k = weight.shape
    if group_size not in INT4_GROUP_SIZES:
        raise ValueError(f"int4 group size must be one of {INT4_GROUP_SIZES}, got {group_size}")
    if k % group_size:
        raise ValueError(f"int4 group size {group_size} does not divide the input size {k}")
    codes = torch.empty(n, k, dtype=torch.uint8, device=weight.device)
    scales = torch.empty(n, k // group_size, dtype=torch.float32, device=weight.device)
    zeros = torch.empty_like(scales)
    top = (1 << bits) - 1
    for start in range(0, n, rows_per_chunk):
        rows = slice(start, start + rows_per_chunk)
        w = weight[rows].float().reshape(-1, k // group_size, group_size)
        lo, hi = w.amin(-1), w.amax(-1)
        s = ((hi - lo) / top).clamp(min=1e-12)
        codes[rows] = torch.round((w - lo[..., None]) / s[..., None]).clamp(0, top).reshape(-1, k)
        scales[rows], zeros[rows] = s, lo + 8 * s
    return codes, scales, zeros


def int4_dequantize(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> torch.Tensor:
    """fp32 W from codes [N, K] and scales / zeros [N, K // g]."""
    group = codes.shape[1] // scales.shape[1]
    expand = lambda t: t.float().repeat_interleave(group, dim=1)  # noqa: E731
    return (codes.float() - 8) * expand(scales) + expand(zeros)


def int4_concatenates(device: torch.device, dtype: torch.dtype, rows: list[int], k: int) -> bool:
    """Whether int4 parts of these row counts (of k inputs), each packed as it is read, join
    into one layer (Int4Linear.concat): on the integer kernel, 16 rows a tile."""
    return base.int8_act_kernel(device, dtype, sum(rows), k) is not None and all(
        r % 16 == 0 for r in rows
    )


def _pack_int4(codes: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
    """The kernel's packed weight, or None where this device has no int4 kernel for `dtype`."""
    try:
        if codes.device.type == "cpu":
            return torch._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32).contiguous(), 1)
        if codes.device.type == "cuda" and dtype == torch.bfloat16:
            k = codes.shape[1]
            inner_k_tiles = next((t for t in (8, 4, 2) if k % (16 * t) == 0), None)
            if inner_k_tiles is None:
                return None
            pairs = (codes[:, ::2] << 4 | codes[:, 1::2]).to(torch.uint8).contiguous()
            return torch._convert_weight_to_int4pack(pairs, inner_k_tiles)
    except (
        RuntimeError,
        AttributeError,
    ) as e:  # an op missing in this torch, or a shape it rejects
        log.debug("int4 pack rejected %s: %s", tuple(codes.shape), e)
    return None
