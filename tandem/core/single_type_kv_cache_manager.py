"""One KV group's share of the KV cache (core/kv_groups.py): each request's blocks for the group's
layers, the group's prefix-cache keys, and what a query of the group still reads. One manager per
group, all over the one block pool the coordinator (kv_cache_coordinator.py) shares out.

A sliding-window group's blocks behind the window of a request's next query are freed and replaced
by `null_block` (never allocated to anyone, never read unmasked), so only the window's blocks stay
held; a full-attention group keeps every block."""

from __future__ import annotations

from typing import cast

from tandem.core.block_pool import BlockPool, KVBlock, hash_block


class SingleTypeKVCacheManager:
    def __init__(self, pool: BlockPool, block_size: int, group_id: int) -> None:
        self.pool, self.block_size, self.group_id = pool, block_size, group_id
        self.req_to_blocks: dict[str, list[KVBlock]] = {}  # block i: tokens [i * bs, (i + 1) * bs)

    def key(self, block_hash: int) -> int:
        """The group's index key for a block of tokens (group 0: the chained hash itself, what
        routers match)."""
        return block_hash if self.group_id == 0 else hash_block(block_hash, (-1 - self.group_id,))

    def lookup(self, block_hash: int, token_ids: tuple[int, ...]) -> KVBlock | None:
        return self.pool.lookup(self.key(block_hash), token_ids)

    def live_from(self, pos: int) -> int:
        """The first block that queries at `pos` and after still read."""
        return 0

    def longest_hit(self, hits: list[KVBlock | None], n: int) -> int:
        """The most blocks, at most n, of a prefix whose lookups are `hits` that this group
        serves to a query right after them."""
        raise NotImplementedError

    def hit_blocks(self, hits: list[KVBlock | None], n: int) -> list[KVBlock]:
        """A hit of n blocks (longest_hit's) as the request's first n blocks."""
        return cast(list[KVBlock], hits[:n])

    def cache_block(self, req_id: str, i: int, block_hash: int, token_ids: tuple[int, ...]) -> None:
        """Index the request's block i, whose KV is computed."""
        self.pool.cache_block(self.req_to_blocks[req_id][i], self.key(block_hash), token_ids)

    def free(self, req_id: str) -> list[KVBlock] | None:
        """Forget the request's blocks; the caller gives them back to the pool."""
        return self.req_to_blocks.pop(req_id, None)


class FullAttentionManager(SingleTypeKVCacheManager):
    def longest_hit(self, hits: list[KVBlock | None], n: int) -> int:
        for i in range(min(n, len(hits))):
            if hits[i] is None:
                return i
        return min(n, len(hits))


class SlidingWindowManager(SingleTypeKVCacheManager):
    def __init__(
        self, pool: BlockPool, block_size: int, group_id: int, null_block: KVBlock, window: int
    ) -> None:
        super().__init__(pool, block_size, group_id)
        self.null_block, self.window = null_block, window
        self._num_skipped: dict[str, int] = {}  # blocks before this are freed (or null) already

    def live_from(self, pos: int) -> int:
        """A query at p sees keys p - window + 1 .. p."""
        return max(0, pos - self.window + 1) // self.block_size

    def longest_hit(self, hits: list[KVBlock | None], n: int) -> int:
        n = min(n, len(hits))
        while n and any(hits[i] is None for i in range(self.live_from(n * self.block_size), n)):
            n -= 1
        return n

    def hit_blocks(self, hits: list[KVBlock | None], n: int) -> list[KVBlock]:
        """The null block where a query right after the hit no longer reads."""
        live = self.live_from(n * self.block_size)
        return [self.null_block if i < live else cast(KVBlock, hits[i]) for i in range(n)]

    def cache_block(self, req_id: str, i: int, block_hash: int, token_ids: tuple[int, ...]) -> None:
        if self.req_to_blocks[req_id][i] is not self.null_block:  # a hit's, behind the window
            super().cache_block(req_id, i, block_hash, token_ids)

    def skipped_blocks(self, req_id: str, pos: int) -> list[int]:
        """The request's blocks, by index, that queries at `pos` and after no longer read and
        that are not freed yet."""
        blocks = self.req_to_blocks.get(req_id)
        if not blocks:
            return []
        start, end = self._num_skipped.get(req_id, 0), min(self.live_from(pos), len(blocks))
        return [i for i in range(start, end) if blocks[i] is not self.null_block]

    def remove_skipped_blocks(self, req_id: str, pos: int, skipped: list[int]) -> list[KVBlock]:
        """Put the null block in place of `skipped` (what skipped_blocks gave); returns the blocks
        taken out, last first, for the caller to give back."""
        blocks = self.req_to_blocks[req_id]
        freed = [blocks[i] for i in reversed(skipped)]
        for i in skipped:
            blocks[i] = self.null_block
        self._num_skipped[req_id] = min(self.live_from(pos), len(blocks))
        return freed

    def free(self, req_id: str) -> list[KVBlock] | None:
        self._num_skipped.pop(req_id, None)
        return super().free(req_id)
