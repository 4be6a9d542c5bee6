"""What the weight-only quantised linear layers (int8.py, int4.py, q6k.py, row_parts.py) share:
the kernel each runs on, chosen when the layer is built.

On a CPU with AVX512-VNNI or AVX2, with bf16 or fp32 activations, they run on
`kernels/cpu_quant_gemm.cpp`: the activations are quantised to int8 in blocks of 32
(W8A8 / W4A8, as llama.cpp's Q8_0 / Q4_1 dot products), 1.9-7x faster than torch's kernels at
every batch size measured on AVX2 (torch's CPU kernels round activations to bf16 and
dequantise every weight); a gate_up layer's activation-and-mul runs in that kernel's epilogue
(`forward_gated`), which saves a pass over the intermediate activations. The tests that compare
a quantised engine with transformers token for token take the weight-only reference path.

Elsewhere int8 and int4 run on torch's own kernels where this device, dtype and shape are accepted
(`torch._weight_int8pack_mm`; `torch._weight_int4pack_mm_for_cpu` on CPU,
`torch._weight_int4pack_mm` on CUDA sm80+ with bf16) and otherwise on the reference path:
dequantise, then `F.linear`. Whether a kernel takes a shape is found by calling it once when
the layer is built (the ops' constraints differ between torch versions), never assumed.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

import torch
from torch import nn

from tandem.kernels import cpu_quant_gemm
from tandem.models.layers.activation import Gate

log = logging.getLogger(__name__)


class IntegerKernelLayer(nn.Module):
    """What the layers the integer-activation kernel runs share: `gemm_weights`, their tables as
    the kernel's view (built once), and `int8_act`, whether the kernel runs them."""

    gemm_weights: list | None
    int8_act: bool

    def _int8_act(self, x2d: torch.Tensor, gate: int) -> torch.Tensor:
        """x2d [M, K] contiguous through the kernel; gate 0, or a Gate its epilogue applies."""
        return cpu_quant_gemm().gemm(x2d, self.gemm_weights, gate)

    def prebound(self, gate: int) -> Callable[[torch.Tensor], torch.Tensor]:
        """`_int8_act` as one native call with its tables bound now (the decode plan's: no
        Python frame between the GEMMs); the tables must stay as they are."""
        return functools.partial(cpu_quant_gemm().gemm, weights=self.gemm_weights, gate=gate)

    @property
    def gates_in_kernel(self) -> bool:
        """Whether `forward_gated` applies the gate in the kernel's epilogue (for a 2-D x): the
        kernel runs the layer, without a bias, and the half-width is a multiple of 16."""
        return self.int8_act and self._buffers["bias"] is None and self.out_features % 32 == 0

    def forward_gated(self, x: torch.Tensor, gate: Gate) -> torch.Tensor:
        """act(gate) * up of a [gate | up] layer's output: in the kernel's epilogue where
        `gates_in_kernel`, else after the layer's forward."""
        if self.gates_in_kernel and x.dim() == 2:
            return self._int8_act(x.contiguous(), gate)
        return gate(self(x))


def block_tiles(v: torch.Tensor, dtype: torch.dtype = torch.float16) -> torch.Tensor:
    """Per-block values [N, blocks] as the integer kernel's [N/16, blocks, 16] tiles."""
    return v.to(dtype).reshape(-1, 16, v.shape[1]).transpose(1, 2).contiguous()


def int8_act_forward(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """A quantised layer (Int8Linear, Int4Linear, Q6KLinear, RowParts of them) on the
    integer-activation kernel; a 2-D contiguous x (the model's flattened batch) goes in as it is:
    at batch 1 each extra view is a visible cost. The bias is read from `_buffers`: as an
    attribute it costs ~1 us (nn.Module finds it in __getattr__, after Python has built an
    AttributeError). The layers' tables reach the kernel as `gemm_weights`, built once: read as
    buffers they cost ~5 us a call, more than the call into the kernel itself."""
    x2d = x if x.dim() == 2 and x.is_contiguous() else x.reshape(-1, layer.in_features).contiguous()
    y = layer._int8_act(x2d, 0)
    if x.dim() != 2:
        y = y.reshape(*x.shape[:-1], layer.out_features)
    bias = layer._buffers["bias"]
    return y if bias is None else y + bias


def int8_act_kernel(device: torch.device, dtype: torch.dtype, n: int, k: int):
    """The integer-activation kernel module where it serves an [n, k] layer (CPU with
    AVX2 or AVX512-VNNI, bf16 or fp32 activations, n % 16 == 0, k % 32 == 0), else None."""
    if device.type != "cpu" or dtype not in (torch.bfloat16, torch.float32) or n % 16 or k % 32:
        return None
    ext = cpu_quant_gemm()
    return ext if ext is not None and ext.supported() else None


def kernel_dtype(device: torch.device, dtype: torch.dtype) -> torch.dtype:
    """What torch's int8 / int4 weight kernels compute in: on CPU bf16 whatever the activations
    (their fp32 path is scalar, 20-100x slower per row; the activations are rounded on the way
    in and the output widened back), elsewhere the activation dtype."""
    return torch.bfloat16 if device.type == "cpu" else dtype


def kernel_accepts(
    kernel, in_features: int, dtype: torch.dtype, device: torch.device, what: str
) -> bool:
    """Call the kernel once on a one-row input: the only reliable test of the op's constraints."""
    try:
        kernel(torch.zeros(1, in_features, dtype=dtype, device=device))
        return True
    except (RuntimeError, AttributeError, NotImplementedError) as e:
        log.debug("%s kernel rejected K=%d %s on %s: %s", what, in_features, dtype, device, e)
        return False
