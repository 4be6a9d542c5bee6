"""A linear layer with LoRA slots: the base layer's output (any precision: float, int8, int4) plus,
for each row that runs with an adapter, that adapter's low-rank product.

The rows of a step are grouped by adapter once per step (`LoRABatch.set`, Punica's SGMV
segments): each layer gathers the adapted rows in that order, runs one pair of small GEMMs per
adapter segment and adds the products back into its output rows."""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from tandem.models.layers.activation import Gate
from tandem.models.lora.adapter import LoRAWeights


class LoRABatch:
    """A step's rows by adapter slot, shared by every LoRA layer of a model."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.rows: torch.Tensor | None = None  # adapted token rows, sorted by slot; None: none
        self.segments: list[tuple[int, int, int]] = []  # (slot, start, end) in `rows`

    def set(self, token_slots: np.ndarray) -> bool:
        """Each token row's slot (-1: the base model). Returns whether any row is adapted."""
        adapted = np.flatnonzero(token_slots >= 0)
        if not len(adapted):
            self.clear()
            return False
        order = adapted[np.argsort(token_slots[adapted], kind="stable")]
        slots = token_slots[order]
        starts = np.flatnonzero(np.diff(slots, prepend=-2))
        ends = np.append(starts[1:], len(order))
        self.segments = list(zip(slots[starts].tolist(), starts.tolist(), ends.tolist()))
        self.rows = torch.from_numpy(order).to(self.device)
        return True

    def clear(self) -> None:
        self.rows, self.segments = None, []


class LoRALinear(nn.Module):
    """`base` with a pair per slot (None: the slot's adapter leaves this layer as it is)."""

    def __init__(self, base: nn.Module, batch: LoRABatch, num_slots: int) -> None:
        super().__init__()
        self.base, self.batch = base, batch
        self.slots: list[LoRAWeights | None] = [None] * num_slots

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        if self.batch.rows is not None:
            add_lora(y, x, self.batch, self.slots)
        return y

    def forward_gated(self, x: torch.Tensor, gate: Gate) -> torch.Tensor:
        if self.batch.rows is None:  # the base's own gated path (fused in its kernel)
            return self.base.forward_gated(x, gate)
        return gate(self.forward(x))


def add_lora(
    y: torch.Tensor, x: torch.Tensor, batch: LoRABatch, slots: list[LoRAWeights | None]
) -> None:
    """y[rows] += (x[rows] @ a.T) @ b.T, one pair of GEMMs per adapter segment."""
    assert batch.rows is not None
    xs = x.index_select(0, batch.rows)
    delta = torch.zeros(xs.shape[0], y.shape[1], dtype=y.dtype, device=y.device)
    for slot, start, end in batch.segments:
        w = slots[slot]
        if w is not None:
            torch.mm(xs[start:end] @ w.a.T, w.b.T, out=delta[start:end])
    y.index_add_(0, batch.rows, delta)
