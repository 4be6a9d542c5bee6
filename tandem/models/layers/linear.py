"""The float linear layer, and its oneDNN-packed form on CPU, for flattened [num_tokens, hidden]
batches."""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from tandem.models.layers.activation import Gate


class Linear(nn.Module):
    """y = x W^T (+ b). Weight-only quantised variants replace this module (same forward)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        # torch.empty: weights are always loaded, so skip the (slow) random init.
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        self.packed: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return cpu_packed_linear(x, self.packed, self.bias)
        return F.linear(x, self.weight, self.bias)

    def forward_gated(self, x: torch.Tensor, gate: Gate) -> torch.Tensor:
        """act(gate) * up of this layer's output [gate | up] (the quantised layers fuse it into
        their GEMM; here it follows the GEMM)."""
        return gate(self(x))

    def pack_for_cpu(self) -> None:
        """Re-lay the weight in oneDNN's blocked format (1.1-3x faster bf16 GEMMs on CPU,
        most at small batches); the plain copy is dropped."""
        self.packed = pack_cpu_weight(self.weight.data)
        self.weight.data = torch.empty(0, dtype=self.weight.dtype)


def can_pack_cpu(weight: torch.Tensor) -> bool:
    return weight.device.type == "cpu" and weight.dtype == torch.bfloat16 and _onednn_bf16_packing()


@functools.cache
def _onednn_bf16_packing() -> bool:
    """oneDNN's bf16 packing needs AVX-512 (or AVX-NE-CONVERT) and says so only when called:
    on an AVX2 CPU it raises, and bf16 linears stay on F.linear."""
    if not torch.backends.mkldnn.is_available() or not hasattr(
        torch.ops.mkldnn, "_reorder_linear_weight"
    ):
        return False
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 16, dtype=torch.bfloat16))
        return True
    except RuntimeError:
        return False


def pack_cpu_weight(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight)


def cpu_packed_linear(
    x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """oneDNN keeps a primitive, with its scratch memory, for every row count it has seen and never
    frees one, so a server whose steps take every size up to max_num_batched_tokens grows for as
    long as it sees new sizes. Rows are padded (with zeros) to one of few sizes instead
    (`padded_rows`)."""
    rows = x.shape[0]
    padded = padded_rows(rows)
    if padded == rows or x.dim() != 2:
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    xp = x.new_empty(padded, x.shape[1])
    xp[:rows] = x
    xp[rows:] = 0
    return torch.ops.mkldnn._linear_pointwise(xp, packed, bias, "none", [], "")[:rows]


def padded_rows(rows: int) -> int:
    """`rows` up to 32, else rounded up to keep its top five bits: 16 sizes per doubling, at most
    1/16 more rows (the small steps, memory-bound, stay exact; the padding costs only large
    ones)."""
    if rows <= 32:
        return rows
    shift = rows.bit_length() - 5
    return -(-rows >> shift) << shift
