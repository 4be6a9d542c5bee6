"""What moves between a prefill and a decode instance: the KV of a prompt's whole blocks,
one contiguous tensor per transfer, plus the small metadata the receiver needs to place it."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(slots=True)
class KVPayload:
    """KV of `token_ids` (whole blocks from position 0), laid out per layer so a transport
    can move and the receiver can place one layer while the next is in flight."""

    token_ids: list[int]
    block_size: int
    kv: torch.Tensor  # [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim], contiguous

    def __post_init__(self) -> None:
        if (
            len(self.token_ids) != self.num_blocks * self.block_size
            or self.kv.shape[3] != self.block_size
        ):
            raise ValueError(
                f"payload of {self.num_blocks} blocks of {self.block_size} tokens "
                f"does not hold {len(self.token_ids)} tokens"
            )

    @property
    def num_blocks(self) -> int:
        return self.kv.shape[2]

    @property
    def num_layers(self) -> int:
        return self.kv.shape[0]

    @property
    def layer_bytes(self) -> int:
        return self.kv[0].numel() * self.kv.element_size() if self.num_layers else 0

    @property
    def num_bytes(self) -> int:
        return self.kv.numel() * self.kv.element_size()

    def meta(self, transfer_id: str) -> dict:
        """JSON-able header: everything but the tensor data."""
        return {
            "transfer_id": transfer_id,
            "token_ids": self.token_ids,
            "block_size": self.block_size,
            "shape": list(self.kv.shape),
            "dtype": str(self.kv.dtype).removeprefix("torch."),
        }


def empty_like_meta(meta: dict, device: torch.device | str = "cpu") -> KVPayload:
    """A payload with an uninitialised tensor of the shape `meta` describes: a receive buffer."""
    kv = torch.empty(meta["shape"], dtype=getattr(torch, meta["dtype"]), device=device)
    return KVPayload(list(meta["token_ids"]), meta["block_size"], kv)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view: every backend moves bytes, whatever the KV dtype (bf16 included)."""
    return t.reshape(-1).view(torch.uint8)


@dataclass(slots=True)
class TransferStats:
    """Bytes moved and wall time of one send or receive; `layer_seconds[l]` is when layer l
    was done (sent or placed), from the start: what overlapped shows in their spacing."""

    num_bytes: int = 0
    seconds: float = 0.0
    layer_seconds: list[float] = field(default_factory=list)

    @property
    def gbps(self) -> float:
        return self.num_bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0
