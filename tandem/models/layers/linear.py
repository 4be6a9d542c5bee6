"""Building blocks of the Llama family, written for flattened [num_tokens, hidden] batches."""
from __future__ import annotations

import enum
import functools
import math

import torch
from torch import nn
import torch.nn.functional as F

from tandem.kernels import cpu_fused_ops


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
    if not torch.backends.mkldnn.is_available() or not hasattr(torch.ops.mkldnn, "_reorder_linear_weight"):
        return False
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 16, dtype=torch.bfloat16))
        return True
    except RuntimeError:
        return False


def pack_cpu_weight(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight)


def cpu_packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """oneDNN keeps a primitive, with its scratch memory, for every row count it has seen and never
    frees one, so a server whose steps take every size up to max_num_batched_tokens grows for as
    long as it sees new sizes. Rows are padded (with zeros) to one of few sizes instead (`padded_rows`)."""
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
    1/16 more rows (the small steps, memory-bound, stay exact; the padding costs only large ones)."""
    if rows <= 32:
        return rows
    shift = rows.bit_length() - 5
    return -(-rows >> shift) << shift


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ext = fused_ops_for(x)
        if ext is not None:  # from _parameters: as an attribute, found only after an AttributeError (~1 us)
            return ext.rms_norm(x, self._parameters["weight"], self.eps)
        # Same op order as transformers (normalise in fp32, scale in the model dtype).
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(residual + x, its norm): the residual add and this norm in one native pass."""
        ext = fused_ops_for(x)
        if ext is not None:
            s, normed = ext.add_rms_norm(x, residual, self._parameters["weight"], self.eps)
            return s, normed
        s = residual + x
        return s, self.forward(s)


def fused_ops_for(x: torch.Tensor):
    """The native fused-op extension for a contiguous CPU [T, H] tensor, else None."""
    if x.device.type != "cpu" or x.dim() != 2 or not x.is_contiguous():
        return None
    return cpu_fused_ops()


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    """Inverse frequencies, with Llama-3 and linear RoPE scaling."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / scaling["factor"]
    if rope_type == "llama3":
        factor = scaling["factor"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, smoothed, scaled)
    raise ValueError(f"unsupported rope scaling type {rope_type!r} (supported: default, linear, llama3)")


class RotaryEmbedding(nn.Module):
    """Rotate-half RoPE (Hugging Face layout) from one fp32 table of cos | sin per position.

    On CPU the table covers the positions seen so far (at least 4,096, grown by doubling up to
    the model's context) rather than the whole context: Gemma 3's two tables of 32k positions
    held 64 MiB, a quarter of its weights, for contexts few requests reach. On CUDA it is built
    whole: a captured graph's positions never pass through Python."""

    MIN_POSITIONS = 4096

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict | None) -> None:
        super().__init__()
        self.max_positions = max_positions
        self.inv_freq = rope_inv_freq(head_dim, theta, scaling)
        self.rounding = torch.float32  # the dtype the table's values are rounded through
        whole = torch.get_default_device().type != "cpu"
        n = max_positions if whole else min(max_positions, self.MIN_POSITIONS)
        self.register_buffer("cos_sin", self._table(n), persistent=False)

    def round_through(self, dtype: torch.dtype) -> None:
        """Round the table's values through `dtype` (kept in fp32), as `model.to(dtype)` then
        `.float()` would, now and as it grows."""
        self.rounding = dtype
        self.cos_sin = self._table(self.cos_sin.shape[0]).to(self.cos_sin.device)

    def _table(self, n: int) -> torch.Tensor:
        freqs = torch.outer(torch.arange(n, dtype=torch.float32, device=self.inv_freq.device), self.inv_freq)
        return torch.cat([freqs.cos(), freqs.sin()], dim=-1).to(self.rounding).float()

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> "StepRope":
        if positions.device.type == "cpu" and positions.numel():
            need = int(positions.max()) + 1
            if need > self.cos_sin.shape[0]:
                size = self.cos_sin.shape[0]
                while size < need:
                    size *= 2
                self.cos_sin = self._table(min(max(size, need), self.max_positions))
        return StepRope(positions, self.cos_sin, dtype)


class StepRope:
    """One step's RoPE, shared by every layer: the native kernel rotates q and k in place; the
    PyTorch path gathers cos / sin once, at the first layer that needs them."""

    def __init__(self, positions: torch.Tensor, table: torch.Tensor, dtype: torch.dtype) -> None:
        self.positions, self.table, self.dtype = positions, table, dtype
        self._cos_sin: tuple[torch.Tensor, torch.Tensor] | None = None

    def rotate_qk_(self, qkv: torch.Tensor, heads: int, head_dim: int) -> bool:
        """Rotate the first `heads` heads (q then k) of each qkv row in place; False: not here."""
        ext = fused_ops_for(qkv)
        if ext is None:
            return False
        ext.rope_(qkv, self.positions, self.table, heads, head_dim)
        return True

    def rotate(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, heads, head_dim]."""
        if self._cos_sin is None:
            cos, sin = self.table[self.positions].chunk(2, dim=-1)
            cos, sin = torch.cat([cos, cos], -1), torch.cat([sin, sin], -1)
            self._cos_sin = cos.unsqueeze(1).to(self.dtype), sin.unsqueeze(1).to(self.dtype)
        return apply_rope(x, *self._cos_sin)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, head_dim]; cos/sin: [T, 1, head_dim]."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


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
