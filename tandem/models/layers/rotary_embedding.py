"""Rotary position embedding (rotate-half, the Hugging Face layout), with Llama-3 and linear
scaling."""

from __future__ import annotations

import math

import torch
from torch import nn


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
    raise ValueError(
        f"unsupported rope scaling type {rope_type!r} (supported: default, linear, llama3)"
    )


class RotaryEmbedding(nn.Module):
    """Rotate-half RoPE (Hugging Face layout) from one fp32 table of cos | sin per position.

    On CPU the table covers the positions seen so far (at least 4,096, grown by doubling up to
    the model's context) rather than the whole context: Gemma 3's two tables of 32k positions
    held 64 MiB, a quarter of its weights, for contexts few requests reach. On CUDA it is built
    whole: a captured graph's positions never pass through Python."""

    MIN_POSITIONS = 4096

    def __init__(
        self, head_dim: int, max_positions: int, theta: float, scaling: dict | None
    ) -> None:
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
        freqs = torch.outer(
            torch.arange(n, dtype=torch.float32, device=self.inv_freq.device), self.inv_freq
        )
        return torch.cat([freqs.cos(), freqs.sin()], dim=-1).to(self.rounding).float()

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> StepRope:
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
