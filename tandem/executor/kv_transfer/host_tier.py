"""The host tier, worker side: the host copy of the KV cache that swapped-out requests' blocks go
to, and each step's swap copies. Which blocks go where is the scheduler side's
(core/kv_connector/host_tier.py)."""

from __future__ import annotations

import torch

from tandem.core.outputs import SchedulerOutput
from tandem.executor.kv_cache import KVCache, gather_blocks, scatter_blocks


class HostTierWorker:
    def __init__(self, kv: KVCache) -> None:
        self.kv = kv
        self._host_kv_cache: torch.Tensor | None = None  # allocated at the first swap-out

    @property
    def host_kv_cache(self) -> torch.Tensor:
        """[layers_per_group, 2, host slots, heads, head_dim] (pinned on GPU machines); zeros,
        like the device cache, so a masked-out slot never holds NaN."""
        if self._host_kv_cache is None:
            cache = self.kv.kv_cache
            rows, _, _, heads, dim = cache.shape
            self._host_kv_cache = torch.zeros(
                rows,
                2,
                self.kv.num_host_blocks * self.kv.block_size,
                heads,
                dim,
                dtype=cache.dtype,
                device="cpu",
                pin_memory=cache.device.type == "cuda",
            )
        return self._host_kv_cache

    def start_load_kv(self, sched: SchedulerOutput) -> None:
        """The step's swaps, before its forward, out first: before anything can reuse the freed
        device blocks."""
        if sched.blocks_to_swap_out:
            self._copy(self.kv.kv_cache, self.host_kv_cache, sched.blocks_to_swap_out)
        if sched.blocks_to_swap_in:
            self._copy(self.host_kv_cache, self.kv.kv_cache, sched.blocks_to_swap_in)

    def _copy(self, src: torch.Tensor, dst: torch.Tensor, pairs: list[tuple[int, int]]) -> None:
        """Copy whole blocks (all layers, K and V) from src to dst (device and host tiers)."""
        bs = self.kv.block_size
        blocks = gather_blocks(src, [a for a, _ in pairs], bs)
        scatter_blocks(dst, [b for _, b in pairs], blocks.to(dst.device, non_blocking=True), bs)
