"""int8 weights with one symmetric scale per output channel (or a GGUF Q8_0 tensor's fp16 scale
per block of 32 inputs, on the integer kernel only)."""

from __future__ import annotations

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


class Int8Linear(IntegerKernelLayer):
    """y = x (q * s)^T + b, q int8 [N, K], s [N]: one scale per output channel; or s [N, K // 32]
    fp16, one per block of 32 inputs (a GGUF Q8_0 tensor as stored), on the integer kernel only.
    On the integer kernel's path `qweight` is packed in place (an int8 tensor passed in becomes
    the kernel's layout)."""

    def __init__(
        self,
        qweight: torch.Tensor,
        scales: torch.Tensor,
        bias: torch.Tensor | None,
        dtype: torch.dtype,
    ) -> None:
        super().__init__()
        self.out_features, self.in_features = qweight.shape
        self.register_buffer("bias", None if bias is None else bias.to(dtype))
        ext = base.int8_act_kernel(qweight.device, dtype, *qweight.shape)
        self.int8_act, self.blocked = ext is not None, scales.dim() == 2
        if self.blocked and not self.int8_act:
            raise ValueError(
                f"int8: scales per block of 32 (GGUF Q8_0) are read by the integer kernel only, "
                f"not for [{self.out_features}, {self.in_features}] {dtype} on {qweight.device}"
            )
        if self.int8_act:  # tiles of q + 128 (see cpu_quant_gemm.cpp), fp32 scales or fp16 d tiles
            self.register_buffer("qweight", ext.pack_int8_(qweight.to(torch.int8).contiguous()))
            self.register_buffer(
                "scales", block_tiles(scales) if self.blocked else scales.float().contiguous()
            )
            self.gemm_weights = [
                ext.int8_weight(self.qweight, self.scales, self.in_features)
            ]  # the kernel's view
            self.use_kernel = False
            return
        self.kernel_dtype = kernel_dtype(qweight.device, dtype)
        self.register_buffer("qweight", qweight.to(torch.int8).contiguous())
        self.register_buffer("scales", scales.to(self.kernel_dtype).contiguous())
        self.use_kernel = kernel_accepts(
            self._kernel, self.in_features, self.kernel_dtype, qweight.device, "int8"
        )
        if not self.use_kernel:  # the reference path dequantises in the activation dtype
            self.scales = scales.to(dtype).contiguous()

    @classmethod
    def from_float(
        cls, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype
    ) -> Int8Linear:
        qweight, scales = quantize_int8(weight)
        return cls(qweight, scales, bias, dtype)

    def _kernel(self, x2d: torch.Tensor) -> torch.Tensor:
        return torch._weight_int8pack_mm(x2d.to(self.kernel_dtype), self.qweight, self.scales).to(
            x2d.dtype
        )

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        if self.int8_act:
            return self.rows(torch.arange(self.out_features), dtype)
        return (self.qweight.float() * self.scales.float()[:, None]).to(dtype)

    def rows(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows `ids` of W, dequantised as `dequantize` does (a Q8_0 block's d q as the gguf
        package computes it): an embedding lookup in this table."""
        if not self.int8_act:
            return (self.qweight[ids].float() * self.scales.float()[ids, None]).to(dtype)
        b = self._buffers
        return (
            cpu_quant_gemm().int8_rows(ids, b["qweight"], b["scales"], self.in_features).to(dtype)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.int8_act:
            return int8_act_forward(self, x)
        if not self.use_kernel:
            return F.linear(x, self.dequantize(x.dtype), self.bias)
        y = self._kernel(x.reshape(-1, self.in_features)).reshape(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias


def quantize_int8(
    weight: torch.Tensor, rows_per_chunk: int = 8192
) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel: q = round(w / s), s = max|w| / 127 (fp32 scales). A chunk
    of rows at a time: an LM head of 262k rows would otherwise hold several fp32 temporaries."""
    qweight = torch.empty(weight.shape, dtype=torch.int8, device=weight.device)
    scales = torch.empty(weight.shape[0], dtype=torch.float32, device=weight.device)
    for start in range(0, weight.shape[0], rows_per_chunk):
        w = weight[start : start + rows_per_chunk].float()
        s = (torch.linalg.vector_norm(w, float("inf"), dim=1) / 127).clamp(
            min=1e-12
        )  # max |w|, one pass
        qweight[start : start + rows_per_chunk] = (w / s[:, None]).round_().clamp_(-127, 127)
        scales[start : start + rows_per_chunk] = s
    return qweight, scales
