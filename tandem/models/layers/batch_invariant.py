"""The deterministic mode's linears: every float GEMM of a model (the LM head included) on a
kernel whose per-row arithmetic does not depend on how many rows share the call
(kernels/cpu_invariant_gemm.cpp: one FMA chain over K per output, weights packed once here).

MKL's fp32 GEMM and oneDNN's bf16 GEMM choose their blocking by the row count, so a request's
logits change in the last bits with the batch it lands in, and greedy tokens follow. The
quantised layers keep their kernels: torch's int8 / int4 CPU kernels and the integer-activation
kernel already compute a row the same way whatever M (tests/test_deterministic_kernels.py
checks).
"""

from __future__ import annotations

import torch
from torch import nn

from tandem.kernels import cpu_invariant_gemm
from tandem.models.layers.activation import Gate
from tandem.models.layers.linear import Linear

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16)


class InvariantLinear(nn.Module):
    """y = x W^T (+ b) on the batch-invariant kernel; W packed in its own dtype."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.register_buffer("panels", cpu_invariant_gemm().pack(weight.contiguous()))
        self.register_buffer("bias", None if bias is None else bias.float().contiguous())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2d = x if x.dim() == 2 else x.reshape(-1, self.in_features)
        y = cpu_invariant_gemm().gemm(x2d, self.panels, self.bias, self.out_features)
        return y if x.dim() == 2 else y.reshape(*x.shape[:-1], self.out_features)

    def forward_gated(self, x: torch.Tensor, gate: Gate) -> torch.Tensor:
        return gate(self(x))


def check_supported(device: torch.device, dtype: torch.dtype) -> None:
    """Refuse, in words, what the deterministic mode cannot honour here."""
    if device.type != "cpu":
        raise ValueError(
            "deterministic serving runs on CPU only for now: on CUDA it needs a batch-invariant "
            "configuration of the Triton kernels, which this version does not have"
        )
    if dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"deterministic serving computes in float32 or bfloat16, not {dtype}")
    if cpu_invariant_gemm() is None:
        raise ValueError(
            "deterministic serving needs the native batch-invariant GEMM (kernels/"
            "cpu_invariant_gemm.cpp), which could not be built here: a C++ compiler is needed "
            "and TANDEM_NO_NATIVE must not be 1"
        )


def make_batch_invariant(model: nn.Module) -> None:
    """Replace every float Linear of a loaded model, and a tied LM head, by an InvariantLinear
    (before any oneDNN packing: the plain weights are read here)."""
    check_supported(model.embed_tokens.weight.device, model.embed_tokens.weight.dtype)
    for name, module in list(model.named_modules()):
        if type(module) is Linear:
            parent, _, attr = name.rpartition(".")
            bias = None if module.bias is None else module.bias.data
            setattr(
                model.get_submodule(parent) if parent else model,
                attr,
                InvariantLinear(module.weight.data, bias),
            )
    if model.lm_head is None:
        model.lm_head = InvariantLinear(model.embed_tokens.weight.data, None)
