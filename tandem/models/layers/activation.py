"""Activations of the gated MLPs: act(gate) * up of a fused [gate | up] projection."""

from __future__ import annotations

import enum

import torch
import torch.nn.functional as F


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x = [gate | up] on the last axis -> silu(gate) * up."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x = [gate | up] on the last axis -> gelu_tanh(gate) * up (Gemma's gated MLP)."""
    gate, up = x.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


class Gate(enum.IntEnum):
    """A gated MLP's activation: act(gate) * up of its [gate | up] projection. The values are the
    integer kernel's (kernels/cpu_quant_gemm.cpp), whose epilogue computes it."""

    SILU = 1
    GELU_TANH = 2

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return silu_and_mul(x) if self is Gate.SILU else gelu_tanh_and_mul(x)
