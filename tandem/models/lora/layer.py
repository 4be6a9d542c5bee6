"""A linear layer with LoRA slots: the base layer's output (any precision: float, int8, int4) plus,
for each row that runs with an adapter, that adapter's low-rank product.

The model runner orders a step's requests by adapter, so each adapter's rows are contiguous
segments of the batch (Punica's SGMV segments), found once per step (`LoRABatch.set`). On a CPU
each layer adds every segment's product in one native call (kernels/cpu_lora_sgmv.cpp: the fixed
cost of ~10 small torch ops per segment and layer made a step's cost grow with its adapters);
elsewhere it runs small GEMMs per segment on its rows (one for the parts' A, one per part's B onto
its output slice), in place, with no gather or scatter."""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from tandem.kernels import cpu_lora_sgmv
from tandem.models.layers.activation import Gate
from tandem.models.lora.adapter import LoRAWeights

# The native kernel's slot table: per slot A's address, rank, parts, then per part (at most 3:
# q, k, v) B's address, first output column, width.
_SLOT_HEAD, _PART_COLS, _MAX_PARTS = 3, 3, 3
_NATIVE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class LoRABatch:
    """A step's segments of rows with an adapter, shared by every LoRA layer of a model."""

    def __init__(self) -> None:
        self.segments: list[tuple[int, int, int]] = []  # (slot, first row, end row)
        self.segment_table = torch.empty(0, 3, dtype=torch.int64)  # the same, for the kernel

    def set(self, token_slots: np.ndarray) -> bool:
        """Each token row's slot (-1: the base model). Returns whether any row is adapted."""
        starts = np.flatnonzero(np.diff(token_slots, prepend=-2))  # where a run of one slot starts
        ends = np.append(starts[1:], len(token_slots))
        slots = token_slots[starts]
        adapted = slots >= 0
        table = np.stack([slots[adapted], starts[adapted], ends[adapted]], axis=1)
        self.segments = [tuple(row) for row in table.tolist()]
        self.segment_table = torch.from_numpy(table.astype(np.int64))
        return bool(self.segments)


class LoRALinear(nn.Module):
    """`base` with a pair per slot (None: the slot's adapter leaves this layer as it is)."""

    def __init__(self, base: nn.Module, batch: LoRABatch, num_slots: int) -> None:
        super().__init__()
        self.base, self.batch = base, batch
        self.slots: list[LoRAWeights | None] = [None] * num_slots
        # each slot's tensors by address for the native kernel (held alive by `slots`)
        self.table = torch.zeros(num_slots, _SLOT_HEAD + _PART_COLS * _MAX_PARTS, dtype=torch.int64)
        self.dtype: torch.dtype | None = None  # the slots' (the kernel reads them as x's)

    def set_slot(self, slot: int, w: LoRAWeights | None) -> None:
        self.slots[slot] = w
        self.table[slot] = 0
        if w is None:
            return
        self.dtype = w.a.dtype
        rank = w.a.shape[0] // len(w.b)
        row = [w.a.data_ptr(), rank, len(w.b)]
        for start, b in zip(w.rows, w.b):
            row += [b.data_ptr(), start, b.shape[0]]
        self.table[slot, : len(row)] = torch.tensor(row)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        if self.batch.segments and self._native(x, y):
            cpu_lora_sgmv().sgmv(x, y, self.batch.segment_table, self.table)
            return y
        for slot, start, end in self.batch.segments:
            w = self.slots[slot]
            if w is None:
                continue
            t = x[start:end] @ w.a.T
            rank = t.shape[1] // len(w.b)
            for i, (row, b) in enumerate(zip(w.rows, w.b)):  # base + delta, as PEFT adds them
                y[start:end, row : row + b.shape[0]] += t[:, i * rank : (i + 1) * rank] @ b.T
        return y

    def _native(self, x: torch.Tensor, y: torch.Tensor) -> bool:
        return (
            x.device.type == "cpu"
            and x.dtype == y.dtype == self.dtype
            and x.dtype in _NATIVE_DTYPES
            and x.dim() == 2
            and x.is_contiguous()
            and y.is_contiguous()
            and cpu_lora_sgmv() is not None
        )

    def forward_gated(self, x: torch.Tensor, gate: Gate) -> torch.Tensor:
        if not self.batch.segments:  # the base's own gated path (fused in its kernel)
            return self.base.forward_gated(x, gate)
        return gate(self.forward(x))
