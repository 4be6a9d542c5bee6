"""Rotary position embedding (rotate-half, the Hugging Face layout), scaled as the model's config
says (layers/rope_scaling.py)."""

from __future__ import annotations

import torch
from torch import nn

from tandem.models.layers.rope_scaling import dynamic_ntk_inv_freq, rope_parameters, rope_type


class RotaryEmbedding(nn.Module):
    """Rotate-half RoPE (Hugging Face layout) from one fp32 table of cos | sin per position.

    On CPU the table covers the positions seen so far (at least 4,096, grown by doubling up to
    the model's context) rather than the whole context: Gemma 3's two tables of 32k positions
    held 64 MiB, a quarter of its weights, for contexts few requests reach. On CUDA it is built
    whole: a captured graph's positions never pass through Python.

    Dynamic NTK scaling: transformers recomputes the frequencies for the length of the sequence
    once it passes the original context, so position p is turned by the set for p + 1 positions
    (its row of the table): the set transformers uses for a token decoded at p. KV then depends
    on the position alone, whatever the batch, chunk or prefix hit. A prompt longer than the
    original context, which transformers' `generate` turns whole by the set for its length,
    is turned here as transformers turns it fed one token at a time."""

    MIN_POSITIONS = 4096

    def __init__(
        self, head_dim: int, max_positions: int, theta: float, scaling: dict | None
    ) -> None:
        super().__init__()
        self.max_positions = max_positions
        self.inv_freq, self.attention_factor = rope_parameters(head_dim, theta, scaling)
        self.dynamic = (head_dim, theta, scaling) if rope_type(scaling) == "dynamic" else None
        self.dynamic_rows = torch.empty(0, head_dim // 2, device="cpu")  # computed once each
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
        positions = torch.arange(n, dtype=torch.float32, device=self.inv_freq.device)
        freqs = torch.outer(positions, self.inv_freq)
        if self.dynamic is not None:
            original = self.dynamic[2]["original_max_position_embeddings"]
            if n > original:
                freqs[original:] = positions[original:, None] * self._dynamic_rows(original, n)
        af = self.attention_factor  # YaRN's mscale; 1.0 otherwise (an exact product)
        return torch.cat([freqs.cos() * af, freqs.sin() * af], dim=-1).to(self.rounding).float()

    def _dynamic_rows(self, start: int, end: int) -> torch.Tensor:
        """Dynamic NTK's frequencies of positions start..end-1, each for a sequence one longer,
        one row at a time as transformers computes them (a vectorised pow rounds differently),
        on CPU, kept as the table grows."""
        done = start + self.dynamic_rows.shape[0]
        if done < end:
            with torch.device("cpu"):
                rows = [
                    dynamic_ntk_inv_freq(*self.dynamic, torch.tensor(p + 1))
                    for p in range(done, end)
                ]
            self.dynamic_rows = torch.cat([self.dynamic_rows, torch.stack(rows)])
        return self.dynamic_rows[: end - start].to(self.inv_freq.device)

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
