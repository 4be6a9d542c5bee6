"""The transport seam: how a payload gets from a prefill instance to a decode instance (shared
memory, torch.distributed); a transfer is matched by id on both sides."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

from tandem.executor.kv_transfer.payload import KVPayload, TransferStats

# Called by `recv` as soon as layer l has landed, so the decode side can write it into its KV
# cache while later layers are still in flight.
LayerSink = Callable[[int, torch.Tensor], None]


class KVTransport(Protocol):
    def send(self, transfer_id: str, payload: KVPayload) -> TransferStats:
        """Move the payload out, layer by layer; returns when its buffers may be reused."""
        ...

    def recv(
        self, transfer_id: str, timeout: float | None = None, on_layer: LayerSink | None = None
    ) -> tuple[KVPayload, TransferStats]:
        """Wait up to `timeout` seconds for the transfer to start (TimeoutError after), then
        receive it whole, calling `on_layer(l, kv[l])` as each layer lands."""
        ...
