"""Fixed-size KV blocks: a free list, reference counts, and the prefix-cache index.

A block is free (ref_cnt 0) or owned by the requests that reference it. A full block can
also be *cached*: indexed by a hash chained on its parent's hash and its token ids, so a
later request with the same prefix reuses it. Cached blocks with no owner stay resident
and are evicted LRU, and only when no plain free block is left.
"""

from __future__ import annotations

import zlib
from collections import OrderedDict
from collections.abc import KeysView
from dataclasses import dataclass


@dataclass(slots=True, eq=False)
class KVBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: int | None = None  # set while the block is in the prefix index
    token_ids: tuple[int, ...] | None = None  # verified on every hit: a hash match is not enough


def hash_block(parent_hash: int | None, token_ids: tuple[int, ...]) -> int:
    """Deterministic across processes (ints and tuples of ints are not salted, but None's
    hash is its address before Python 3.12), so instances and the router agree on hashes."""
    return hash((-1 if parent_hash is None else parent_hash, token_ids))


def salt_hash(cache_salt: str | None) -> int | None:
    """The parent hash of a prompt's first block: None, or its cache salt's (a precision
    variant's KV lives in its own namespace; the router chains the same root)."""
    return None if cache_salt is None else hash_block(None, (zlib.crc32(cache_salt.encode()),))


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}")
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))  # stack: pops block 0 first
        self._evictable: OrderedDict[int, KVBlock] = OrderedDict()  # cached, unowned, LRU first
        self._cached: dict[int, KVBlock] = {}
        self.num_evictions = 0

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        """Blocks a new allocation can take: plain free ones plus evictable cached ones."""
        return len(self._free) + len(self._evictable)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    @property
    def cached_hashes(self) -> KeysView[int]:
        """The prefix index's block hashes, oldest first (a live view: what routers match)."""
        return self._cached.keys()

    def get_new_blocks(self, n: int) -> list[KVBlock]:
        if n > self.num_free_blocks:
            raise RuntimeError(f"asked for {n} KV blocks, {self.num_free_blocks} free")
        out = []
        for _ in range(n):
            if self._free:
                block = self.blocks[self._free.pop()]
            else:
                _, block = self._evictable.popitem(last=False)
                self._uncache(block)
                self.num_evictions += 1
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, blocks: list[KVBlock]) -> None:
        """Take a reference on prefix-cache hits (pulling unowned ones out of the LRU)."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self._evictable[block.block_id]
            block.ref_cnt += 1

    def free_blocks(self, blocks: list[KVBlock]) -> None:
        """Drop a reference. Pass a request's blocks tail first: tails are evicted first."""
        for block in blocks:
            if block.ref_cnt <= 0:
                raise RuntimeError(f"KV block {block.block_id} freed twice")
        for block in blocks:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.block_hash is None:
                    self._free.append(block.block_id)
                else:
                    self._evictable[block.block_id] = block

    def lookup(self, block_hash: int, token_ids: tuple[int, ...]) -> KVBlock | None:
        block = self._cached.get(block_hash)
        if block is None or block.token_ids != token_ids:
            return None
        return block

    def cache_block(self, block: KVBlock, block_hash: int, token_ids: tuple[int, ...]) -> None:
        """Index a full, computed block. A duplicate of an indexed block stays unindexed."""
        if block.block_hash is not None or block_hash in self._cached:
            return
        block.block_hash, block.token_ids = block_hash, token_ids
        self._cached[block_hash] = block

    def reset_prefix_cache(self) -> None:
        for block in list(self._evictable.values()):
            self._uncache(block)
            self._free.append(block.block_id)
        self._evictable.clear()

    def _uncache(self, block: KVBlock) -> None:
        if block.block_hash is not None:
            del self._cached[block.block_hash]
        block.block_hash, block.token_ids = None, None
