"""P/D disaggregation, scheduler side: blocks reserved on a decode instance for a prompt's KV
before a prefill instance sends it (the request's quota here), indexed in the prefix cache once
written, and pinned until the decode request that reads them is admitted or gone; and, on the
prefill side, the prompt's cached blocks to export. The worker side, which reads and writes their
bytes, is executor/kv_transfer/handoff.py."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from tandem.core.kv_cache_coordinator import KVCacheCoordinator, PerGroup
from tandem.core.kv_connector.base import KVConnectorScheduler
from tandem.core.outputs import SchedulerOutput
from tandem.core.request import Request, RequestStatus


class KVPoolFullError(RuntimeError):
    """Too few free KV blocks here for a transfer: send it to another instance, or wait."""


@dataclass(slots=True, eq=False)
class KVReservation:
    """Blocks held for KV computed on another instance. `blocks[k][i]` is group k's block for
    block i of `token_ids` (the null block where a query after them would not read it); those
    listed in `fresh[k]` are to be written, the rest were already cached here and are pinned."""

    token_ids: list[int]
    hashes: list[int]
    blocks: list[list]  # per KV group
    fresh: list[list[int]]  # per KV group

    @property
    def num_blocks(self) -> int:
        """Blocks of block_size tokens held (one in each group)."""
        return len(self.blocks[0])

    @property
    def num_fresh_blocks(self) -> int:
        return sum(len(f) for f in self.fresh)


class PDConnector(KVConnectorScheduler):
    """`requests`: the scheduler's, by id (a pin is dropped once its request is no longer
    waiting there)."""

    def __init__(self, coordinator: KVCacheCoordinator, requests: Mapping[str, Request]) -> None:
        self.coordinator, self.requests = coordinator, requests
        self.pins: dict[str, KVReservation] = {}  # request id -> blocks held until it is admitted

    def _num_transfer_blocks(self, token_ids: list[int]) -> int:
        c = self.coordinator
        return c.prefix_limit(len(token_ids)) // c.block_size

    def cached_prefix(self, token_ids: list[int]) -> tuple[PerGroup, int]:
        """The longest run of whole blocks of `token_ids` in the prefix cache (nothing taken):
        each group's blocks, and how many."""
        c, n = self.coordinator, self._num_transfer_blocks(token_ids)
        hashes = (h for h, _ in c.block_hashes(token_ids, None, n))  # lazy: a miss ends it
        return c.find_longest_cache_hit(token_ids, hashes)

    def reserve(self, token_ids: list[int]) -> KVReservation | None:
        """Hold a block in each group for each whole block of `token_ids` that a later prefix
        lookup would reach. A group that would not read a block gets the null block there.
        Blocks cached here already are pinned, not taken anew. None when blocks are short;
        nothing changes then."""
        c = self.coordinator
        n, null = self._num_transfer_blocks(token_ids), c.null_block
        hashes, chunks = [], []
        for h, chunk in c.block_hashes(token_ids, None, n):
            hashes.append(h)
            chunks.append(chunk)
        blocks = []
        for m in c.managers:
            live = m.live_from(n * c.block_size)
            blocks.append(
                [
                    null if i < live else m.lookup(h, chunk)
                    for i, (h, chunk) in enumerate(zip(hashes, chunks))
                ]
            )
        fresh = [[i for i, b in enumerate(row) if b is None] for row in blocks]
        pinned = [b for row in blocks for b in row if b is not None and b is not null]
        num_fresh = sum(len(f) for f in fresh)
        if num_fresh > c.pool.num_free_blocks - sum(1 for b in pinned if b.ref_cnt == 0):
            return None
        c.pool.touch(pinned)
        new = iter(c.pool.get_new_blocks(num_fresh))
        for i in range(n):  # taken in the order of flat_block_ids
            for row in blocks:
                if row[i] is None:
                    row[i] = next(new)
        return KVReservation(list(token_ids[: n * c.block_size]), hashes, blocks, fresh)

    def commit(self, res: KVReservation, num_blocks: int) -> None:
        """Index the first `num_blocks` blocks, now written, in the prefix cache, and give back
        the rest (the sender had fewer). The reservation still pins what it keeps."""
        c, bs = self.coordinator, self.coordinator.block_size
        fresh = [set(f) for f in res.fresh]
        for i in range(min(num_blocks, res.num_blocks)):
            for m, row, f in zip(c.managers, res.blocks, fresh):
                if i in f:
                    chunk = tuple(res.token_ids[i * bs : (i + 1) * bs])
                    c.pool.cache_block(row[i], m.key(res.hashes[i]), chunk)
        c.pool.free_blocks(c.tail_first([row[num_blocks:] for row in res.blocks]))
        for row in res.blocks:
            del row[num_blocks:]
        del res.hashes[num_blocks:], res.token_ids[num_blocks * bs :]
        res.fresh = [[i for i in f if i < num_blocks] for f in res.fresh]

    def release(self, res: KVReservation) -> None:
        """Drop the reservation's pins (tail first); committed blocks stay cached, evictable."""
        self.coordinator.pool.free_blocks(self.coordinator.tail_first(res.blocks))
        for row in res.blocks:
            row.clear()

    def fresh_block_ids(self, res: KVReservation, num_blocks: int) -> tuple[list[int], list[int]]:
        """The indices among the first `num_blocks` blocks that have KV to write, and the block
        ids to write it into, in flat_block_ids' layout. Where a group's block is already cached
        here or lies behind its window, that group's write goes to the null block. The null
        block is never read unmasked, so nothing cached is overwritten."""
        fresh = [set(f) for f in res.fresh]
        written = sorted({i for f in fresh for i in f if i < num_blocks})
        null = self.coordinator.null_block
        # A block listed fresh is a real one, never the None of a window's gap.
        ids = [
            row[i].block_id if i in f else null.block_id  # type: ignore[union-attr]
            for i in written
            for row, f in zip(res.blocks, fresh)
        ]
        return written, ids

    def pin(self, request_id: str, res: KVReservation) -> None:
        """Keep `res` pinned until `request_id` is admitted or gone."""
        self.pins[request_id] = res

    def build_connector_meta(self, out: SchedulerOutput) -> None:
        """Unpin for requests admitted (they hold their own references now) or gone."""
        for req_id in list(self.pins):
            req = self.requests.get(req_id)
            if req is None or req.status != RequestStatus.WAITING:
                self.release(self.pins.pop(req_id))

    def request_finished(self, req_id: str) -> None:
        res = self.pins.pop(req_id, None)
        if res is not None:
            self.release(res)
