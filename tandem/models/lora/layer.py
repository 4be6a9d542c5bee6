"""A linear layer with LoRA slots: the base layer's output (any precision: float, int8, int4) plus,
for each row that runs with an adapter, that adapter's low-rank product.

The model runner orders a step's requests by adapter, so each adapter's rows are contiguous
segments of the batch (Punica's SGMV segments), found once per step (`LoRABatch.set`): each
layer runs small GEMMs per segment on its rows (one for the parts' A, one per part's B onto its
output slice), in place, with no gather or scatter."""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from tandem.models.layers.activation import Gate
from tandem.models.lora.adapter import LoRAWeights


class LoRABatch:
    """A step's segments of rows with an adapter, shared by every LoRA layer of a model."""

    def __init__(self) -> None:
        self.segments: list[tuple[int, int, int]] = []  # (slot, first row, end row)

    def set(self, token_slots: np.ndarray) -> bool:
        """Each token row's slot (-1: the base model). Returns whether any row is adapted."""
        starts = np.flatnonzero(np.diff(token_slots, prepend=-2))  # where a run of one slot starts
        ends = np.append(starts[1:], len(token_slots))
        slots = token_slots[starts]
        adapted = slots >= 0
        self.segments = list(
            zip(slots[adapted].tolist(), starts[adapted].tolist(), ends[adapted].tolist())
        )
        return bool(self.segments)


class LoRALinear(nn.Module):
    """`base` with a pair per slot (None: the slot's adapter leaves this layer as it is)."""

    def __init__(self, base: nn.Module, batch: LoRABatch, num_slots: int) -> None:
        super().__init__()
        self.base, self.batch = base, batch
        self.slots: list[LoRAWeights | None] = [None] * num_slots

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        for slot, start, end in self.batch.segments:
            w = self.slots[slot]
            if w is None:
                continue
            t = x[start:end] @ w.a.T
            rank = t.shape[1] // len(w.b)
            for i, (row, b) in enumerate(zip(w.rows, w.b)):  # base + delta, as PEFT adds them
                y[start:end, row : row + b.shape[0]] += t[:, i * rank : (i + 1) * rank] @ b.T
        return y

    def forward_gated(self, x: torch.Tensor, gate: Gate) -> torch.Tensor:
        if not self.batch.segments:  # the base's own gated path (fused in its kernel)
            return self.base.forward_gated(x, gate)
        return gate(self.forward(x))
