"""A GGUF Q6_K tensor served as it is stored, on the integer-activation kernel
(`kernels/cpu_quant_gemm.cpp`, its q6k tiles): w = d sc (q - 32) with 6-bit codes q, an int8
scale sc per 16 inputs and an fp16 d per 256, 0.82 bytes a weight as in the file, where an
int8 copy takes 1 byte and is requantised. The kernel multiplies unsigned 6-bit codes by int8
activations directly (no sign trick on AVX2); unpacking the codes costs what that saves, so a
Q6_K layer runs about as fast as its int8 copy where the step is compute-bound (batch 16) and
faster where it waits on memory (a large layer at batch 1: 18% fewer bytes).

Built only where that kernel serves the layer (`q6k_kernel`); elsewhere (CUDA, a CPU without
AVX2) the builder requantises Q6_K to int8 per channel.
"""

from __future__ import annotations

import torch

from tandem.kernels import cpu_quant_gemm
from tandem.models.quantization import base
from tandem.models.quantization.base import IntegerKernelLayer, block_tiles, int8_act_forward
from tandem.models.quantization.host_memory import huge_empty

QK_K = 256  # inputs per Q6_K block (one d), in sub-blocks of 16 (one sc each)


def q6k_kernel(device: torch.device, dtype: torch.dtype, n: int, k: int):
    """The kernel module where it serves an [n, k] Q6_K layer, else None."""
    return base.int8_act_kernel(device, dtype, n, k) if k % QK_K == 0 else None


class Q6KLinear(IntegerKernelLayer):
    """y = x W^T + b, W[n, k] = d[n, k // 256] * sc[n, k // 16] * (q[n, k] - 32)."""

    def __init__(
        self, n: int, k: int, bias: torch.Tensor | None, dtype: torch.dtype, device: torch.device
    ) -> None:
        """An [n, k] layer whose rows `load` fills, a slice at a time: a fused layer's parts and a
        vocabulary's rows are packed straight into its tiles, never held twice."""
        super().__init__()
        self.out_features, self.in_features = n, k
        ext = q6k_kernel(device, dtype, n, k)
        if ext is None:
            raise ValueError(
                f"Q6_K: no integer kernel for [{n}, {k}] {dtype} on {device} "
                "(AVX2 or AVX512-VNNI CPU, N % 16, K % 256)"
            )
        self.register_buffer("bias", None if bias is None else bias.to(dtype))
        self.register_buffer(
            "qpacked", huge_empty((n * k // 2,), torch.uint8, device)
        )  # low nibbles
        self.register_buffer("qtop", huge_empty((n * k // 4,), torch.uint8, device))
        # sc as [N/16, K/32, 2 (sub-block), 16 (column)], d as [N/16, K/256, 16]
        self.register_buffer(
            "sc", torch.empty(n // 16, k // 32, 2, 16, dtype=torch.int8, device=device)
        )
        self.register_buffer(
            "d", torch.empty(n // 16, k // QK_K, 16, dtype=torch.float16, device=device)
        )
        self.int8_act = True
        self.gemm_weights = [
            ext.q6k_weight(self.qpacked, self.qtop, self.sc, self.d, n)
        ]  # the kernel's view

    @classmethod
    def from_codes(
        cls,
        codes: torch.Tensor,
        sc: torch.Tensor,
        d: torch.Tensor,
        bias: torch.Tensor | None,
        dtype: torch.dtype,
    ) -> Q6KLinear:
        layer = cls(*codes.shape, bias, dtype, codes.device)
        layer.load(0, codes, sc, d)
        return layer

    def load(self, start: int, codes: torch.Tensor, sc: torch.Tensor, d: torch.Tensor) -> None:
        """Rows start:start + len(codes) from the file's blocks: codes [rows, K] in [0, 63], sc
        [rows, K // 16] int8, d [rows, K // 256] fp16; start and rows multiples of 16."""
        rows, k = codes.shape
        if start % 16 or rows % 16 or start + rows > self.out_features or k != self.in_features:
            raise ValueError(
                f"Q6_K: rows {start}:{start + rows} of [{self.out_features}, {self.in_features}] "
                "in whole tiles of 16"
            )
        if codes.numel() and int(codes.max()) > 63:
            raise ValueError("Q6_K: a code above 63")
        ext = cpu_quant_gemm()
        # the tiles' order of a block's inputs: packed input 16 l + 4 j + i is input 8 j + 4 l + i
        # (a chunk's two nibble lanes one sub-block)
        codes = codes.reshape(rows, k // 32, 4, 2, 4).transpose(2, 3).reshape(rows, k)
        self.qpacked[start * k // 2 : (start + rows) * k // 2] = ext.pack_int4(codes)
        self.qtop[start * k // 4 : (start + rows) * k // 4] = ext.pack_top_bits(codes)
        tiles = slice(start // 16, (start + rows) // 16)
        self.sc[tiles] = sc.to(torch.int8).reshape(-1, 16, k // 32, 2).permute(0, 2, 3, 1)
        self.d[tiles] = block_tiles(d)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """W as the gguf package dequantises the file's blocks: d sc in fp32, times q - 32."""
        return self.rows(torch.arange(self.out_features), dtype)

    def rows(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows `ids` of W: an embedding lookup in this table (a tied Q6_K vocabulary)."""
        b = self._buffers
        return (
            cpu_quant_gemm()
            .q6k_rows(ids, b["qpacked"], b["qtop"], b["sc"], b["d"], self.in_features)
            .to(dtype)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return int8_act_forward(self, x)
