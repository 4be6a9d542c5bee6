"""The host tier: a preempted request's blocks copied to host memory (swap-out) and back (swap-in)
instead of recomputed. Here the host blocks are handed out; the copies are the worker side's
(executor/kv_transfer/host_tier.py), from the step's blocks_to_swap_out / blocks_to_swap_in.

Host blocks a swap-in reads are reusable only from the next step: the worker copies a step's
swap-outs first, so one in the same step would overwrite them before they are read."""

from __future__ import annotations

from tandem.core.kv_cache_coordinator import KVCacheCoordinator, flat_block_ids
from tandem.core.kv_connector.base import KVConnectorScheduler
from tandem.core.request import Request

HostBlocks = list[list[int | None]]  # per KV group, as the device blocks were; None: the null block


class HostTierConnector(KVConnectorScheduler):
    def __init__(self, coordinator: KVCacheCoordinator, num_host_blocks: int) -> None:
        self.coordinator = coordinator
        self.num_host_blocks = num_host_blocks
        self._free: list[int] = list(range(num_host_blocks - 1, -1, -1))
        self._pending: list[int] = []  # read by this step's swap-ins
        self.req_to_host_blocks: dict[str, HostBlocks] = {}

    @property
    def num_free_host_blocks(self) -> int:
        return len(self._free)

    @property
    def num_swapped(self) -> int:
        """Requests whose KV is in the host tier."""
        return len(self.req_to_host_blocks)

    def blocks_needed(self, req: Request, num_new: int) -> int:
        """Free device blocks `swap_in` would take for a swapped request."""
        host = self.req_to_host_blocks[req.request_id]
        return self.coordinator.blocks_needed_like(req, host, num_new)

    def swap_out(self, req: Request) -> list[tuple[int, int]] | None:
        """Move the request's blocks to the host tier: (device, host) pairs to copy, or None
        when the host pool lacks room (nothing changed then)."""
        blocks = self.coordinator.get_blocks(req.request_id)
        null = self.coordinator.null_block
        real = sum(b is not null for row in blocks for b in row)
        if not real or real > len(self._free):
            return None
        host: HostBlocks = [[] for _ in blocks]
        pairs = []
        for row in zip(*blocks):  # taken in the order of flat_block_ids
            for k, b in enumerate(row):
                h = None if b is null else self._free.pop()
                host[k].append(h)
                if h is not None:
                    pairs.append((b.block_id, h))
        self.coordinator.free(req.request_id)
        self.req_to_host_blocks[req.request_id] = host
        return pairs

    def swap_in(self, req: Request, num_new: int) -> tuple[list[tuple[int, int]], list[int]] | None:
        """Bring a swapped request back with room for `num_new` more tokens: (host, device)
        pairs to copy and all its device block ids, or None when device blocks are short."""
        host = self.req_to_host_blocks[req.request_id]
        blocks = self.coordinator.allocate_like(req, host, num_new)
        if blocks is None:
            return None
        del self.req_to_host_blocks[req.request_id]
        pairs = [
            (h, b.block_id)
            for hs, bs in zip(zip(*host), zip(*blocks))
            for h, b in zip(hs, bs)
            if h is not None
        ]
        self._pending.extend(h for h, _ in pairs)
        return pairs, flat_block_ids(blocks)

    def release_pending_host_blocks(self) -> None:
        """The last step's swap-ins have read their host blocks (the scheduler calls this as
        it plans the next)."""
        self._free.extend(self._pending)
        self._pending.clear()

    def request_finished(self, req_id: str) -> None:
        host = self.req_to_host_blocks.pop(req_id, None)
        if host:
            self._free.extend(h for row in zip(*host) for h in row if h is not None)
