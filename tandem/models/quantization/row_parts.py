"""A fused layer whose row parts are stored in different formats."""

from __future__ import annotations

import torch
from torch import nn

from tandem.models.quantization.base import IntegerKernelLayer, int8_act_forward


class RowParts(IntegerKernelLayer):
    """A fused layer (qkv, gate_up) whose row parts are served in different formats (a Q4_K_M
    file's Q4_K q and k beside its Q6_K v). Where every part is on the integer kernel without a
    bias, one call runs them all (one parallel region, the output written once; as two calls and
    a cat, a ~1B's qkv took 200 us against 148 for a single format's 7% fewer bytes); else each
    part runs on its own kernel and the outputs are joined."""

    def __init__(self, parts: list[nn.Module]) -> None:
        super().__init__()
        self.parts = nn.ModuleList(parts)
        self.in_features = parts[0].in_features
        self.out_features = sum(p.out_features for p in parts)
        self.register_buffer("bias", None)  # the parts hold theirs
        self.int8_act = all(getattr(p, "int8_act", False) and p.bias is None for p in parts)
        self.gemm_weights = [w for p in parts for w in p.gemm_weights] if self.int8_act else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.int8_act:
            return int8_act_forward(self, x)
        return torch.cat([part(x) for part in self.parts], -1)

    @property
    def gates_in_kernel(self) -> bool:
        return False  # the kernel takes a gate for one weight only
