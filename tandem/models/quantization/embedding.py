"""A quantised vocabulary table read as an embedding."""

from __future__ import annotations

import torch
from torch import nn


class QuantEmbedding(nn.Module):
    """An embedding read from a quantised table (Int8Linear, Q6KLinear, or Int4Linear of a file's
    own 4- or 5-bit codes): a quantised variant's tied LM head serves as its embedding too, so the
    vocabulary is held once, quantised, not again in floats."""

    def __init__(self, table: nn.Module, dtype: torch.dtype) -> None:
        super().__init__()
        self.table, self.dtype = table, dtype

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        shape = ids.shape
        return self.table.rows(ids.reshape(-1), self.dtype).reshape(*shape, self.table.in_features)
