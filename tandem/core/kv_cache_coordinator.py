"""One block pool shared out among the KV groups' managers (single_type_kv_cache_manager.py): a
request's blocks taken and given back for every group at once, the prefix-cache hit every group
serves, and the blocks behind sliding windows freed.

The groups' block lists meet in one place, `flat_block_ids`: the layout the executor's block
tables are built from (G entries per logical block of block_size tokens)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence

from tandem.core.block_pool import BlockPool, KVBlock, hash_block, salt_hash
from tandem.core.request import Request
from tandem.core.single_type_kv_cache_manager import (
    FullAttentionManager,
    SingleTypeKVCacheManager,
    SlidingWindowManager,
)

PerGroup = Sequence[list[KVBlock]]  # one list per KV group, block i of each for the same tokens
Layout = Sequence[Sequence[object | None]]  # a request's blocks per group elsewhere (host tier)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def flat_block_ids(blocks: PerGroup) -> list[int]:
    """The executor's layout of a request's blocks (executor/input_batch.py, KVCache.read_blocks):
    entry i * G + k is group k's block i."""
    if len(blocks) == 1:
        return [b.block_id for b in blocks[0]]
    return [b.block_id for row in zip(*blocks) for b in row]


class KVCacheCoordinator:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        group_windows: tuple[int | None, ...],
        enable_caching: bool = True,
        max_prefix_tokens: int | None = None,
    ) -> None:
        self.block_size, self.group_windows = block_size, group_windows
        self.num_groups = len(group_windows)
        self.enable_caching, self.max_prefix_tokens = enable_caching, max_prefix_tokens
        # Where a sliding group's freed blocks point: one block past the `num_blocks` served (the
        # executor allocates it), taken first, so it is block 0 (the pad of every block table),
        # and held for good.
        sliding = any(w is not None for w in group_windows)
        self.pool = BlockPool(num_blocks + sliding)
        self.null_block: KVBlock | None = None
        self.managers: list[SingleTypeKVCacheManager] = []
        for k, window in enumerate(group_windows):
            if window is None:
                self.managers.append(FullAttentionManager(self.pool, block_size, k))
                continue
            if self.null_block is None:
                self.null_block = self.pool.get_new_blocks(1)[0]
            self.managers.append(
                SlidingWindowManager(self.pool, block_size, k, self.null_block, window)
            )
        self._full = [m for m in self.managers if isinstance(m, FullAttentionManager)]
        self._sliding = [m for m in self.managers if isinstance(m, SlidingWindowManager)]
        self._no_hit: PerGroup = tuple([] for _ in self.managers)  # never extended
        self._num_indexed: dict[str, int] = {}  # the request's full blocks in the prefix index
        self._req_tokens: dict[str, int] = {}  # tokens whose KV the request holds

    @property
    def num_blocks(self) -> int:
        """Blocks requests can hold (the null block aside)."""
        return self.pool.num_blocks - (self.null_block is not None)

    def num_held_blocks(self, req_id: str) -> int:
        """Logical blocks (block_size tokens, one block in each group) the request holds."""
        return len(self.managers[0].req_to_blocks.get(req_id, ()))

    def get_blocks(self, req_id: str) -> PerGroup:
        return [m.req_to_blocks.get(req_id, []) for m in self.managers]

    def block_ids(self, req_id: str) -> list[int]:
        return flat_block_ids(self.get_blocks(req_id))

    # ---- prefix cache -------------------------------------------------------------
    def prefix_limit(self, num_tokens: int) -> int:
        """Of `num_tokens` tokens, those the prefix cache may index or serve."""
        cap = self.max_prefix_tokens
        return num_tokens if cap is None else min(num_tokens, cap)

    def block_hashes(
        self, token_ids: list[int], parent: int | None, num_blocks: int
    ) -> Iterator[tuple[int, tuple[int, ...]]]:
        """(chained hash, tokens) of the first `num_blocks` whole blocks of `token_ids`."""
        bs = self.block_size
        for i in range(num_blocks):
            chunk = tuple(token_ids[i * bs : (i + 1) * bs])
            parent = hash_block(parent, chunk)
            yield parent, chunk

    def request_block_hashes(self, req: Request, num_blocks: int) -> list[int]:
        """`req.block_hashes`, extended to its first `num_blocks` whole blocks (fewer when it
        has fewer); it may hold more. Each block is hashed once in the request's life, however
        often its admission is tried, and across preemptions."""
        hashes = req.block_hashes
        if len(hashes) < num_blocks:
            tokens, bs = req.all_token_ids, self.block_size
            parent = hashes[-1] if hashes else salt_hash(req.cache_salt)
            for i in range(len(hashes), min(num_blocks, len(tokens) // bs)):
                parent = hash_block(parent, tuple(tokens[i * bs : (i + 1) * bs]))
                hashes.append(parent)
        return hashes

    def find_longest_cache_hit(
        self, token_ids: list[int], hashes: Iterable[int]
    ) -> tuple[PerGroup, int]:
        """The longest run of whole blocks of `token_ids` (`hashes`: their chained hashes, as
        many as may be served) that every group serves to a query right after it: each group's
        blocks, and how many."""
        hits: list[list[KVBlock | None]] = [[] for _ in self.managers]
        bs = self.block_size
        for i, h in enumerate(hashes):
            chunk = tuple(token_ids[i * bs : (i + 1) * bs])
            row = [m.lookup(h, chunk) for m in self.managers]
            if any(row[m.group_id] is None for m in self._full):
                break
            for found, b in zip(hits, row):
                found.append(b)
        n = len(hits[0])
        while True:  # each group's longest hit within the others', until they agree
            agreed = n
            for m in self.managers:
                agreed = m.longest_hit(hits[m.group_id], agreed)
            if agreed == n:
                break
            n = agreed
        return [m.hit_blocks(hits[m.group_id], n) for m in self.managers], n

    def cache_blocks(self, req: Request) -> None:
        """Index the request's full blocks whose KV is computed (call after the step ran)."""
        if not self.enable_caching:
            return
        rid, bs = req.request_id, self.block_size
        done = self._num_indexed.get(rid)
        if done is not None and (done + 1) * bs > req.num_computed_tokens:
            return  # no new full block (most steps): the rest is off a request's hot path
        held = self.num_held_blocks(rid)
        if not held:
            return
        if done is None:
            done = self._num_indexed[rid] = 0
        tokens = req.all_token_ids
        # Known tokens only: a verify step in flight has num_computed_tokens past them, over
        # drafts not yet accepted (speculative decoding).
        end = min(self.prefix_limit(min(req.num_computed_tokens, len(tokens))) // bs, held)
        if end <= done:
            return
        hashes = self.request_block_hashes(req, end)
        for i in range(done, end):
            chunk = tuple(tokens[i * bs : (i + 1) * bs])
            for m in self.managers:
                m.cache_block(rid, i, hashes[i], chunk)
        self._num_indexed[rid] = end

    # ---- allocation ---------------------------------------------------------------
    def _skipped(self, req: Request) -> list[tuple[SlidingWindowManager, list[int]]]:
        pos = req.num_computed_tokens
        return [(m, m.skipped_blocks(req.request_id, pos)) for m in self._sliding]

    def remove_skipped_blocks(self, req: Request) -> None:
        """Give back the blocks behind the request's sliding windows (theirs alone go free; a
        block a prefix hit shares stays with its other owners)."""
        if not self._sliding:
            return
        skipped = self._skipped(req)
        if not any(s for _, s in skipped):
            return
        # Indexed first: under async scheduling the step that computed them may still be running
        # (it runs before any step that could hit them), and a later prompt with this prefix
        # needs the window's blocks before its end.
        self.cache_blocks(req)
        freed: list[KVBlock] = []
        for m, s in reversed(skipped):
            freed += m.remove_skipped_blocks(req.request_id, req.num_computed_tokens, s)
        self.pool.free_blocks(freed)

    def _count(self, req: Request, num_new: int, hit: PerGroup) -> tuple[int, int, int]:
        """For `num_new` more tokens after `hit`: the tokens the request then holds, the
        logical blocks it holds now, and the new blocks it takes (in all groups)."""
        num_hit = len(hit[0]) if hit else 0
        total = req.num_computed_tokens + num_hit * self.block_size + num_new
        held = len(self.managers[0].req_to_blocks.get(req.request_id, ()))  # num_held_blocks
        return total, held, max(cdiv(total, self.block_size) - held - num_hit, 0) * self.num_groups

    @staticmethod
    def _reusable(hit: PerGroup) -> int:
        """Hits that sit unowned in the LRU: they count as free now; touching them takes them."""
        return sum(1 for blocks in hit for b in blocks if b.ref_cnt == 0)

    def blocks_needed(self, req: Request, num_new: int, hit: PerGroup = ()) -> int:
        """Free blocks `allocate` would take for `num_new` more tokens: new ones, less those
        freed behind sliding windows, plus unowned prefix hits. May be negative (a step that
        frees more than it takes)."""
        rid = req.request_id
        freed = (
            sum(1 for m, s in self._skipped(req) for i in s if m.req_to_blocks[rid][i].ref_cnt == 1)
            if self._sliding
            else 0
        )
        return self._count(req, num_new, hit)[2] + (self._reusable(hit) if hit else 0) - freed

    def allocate(self, req: Request, num_new: int, hit: PerGroup = ()) -> list[int] | None:
        """Room for `num_new` more tokens after `req.num_computed_tokens` (plus `hit`, prefix
        hits taken now), first freeing the blocks behind its sliding windows. Returns the new
        blocks' ids (flat_block_ids), or None when free blocks are short (nothing else changes
        then)."""
        if self._sliding:
            self.remove_skipped_blocks(req)
        rid, G = req.request_id, self.num_groups
        if not hit:  # the tokens fit the blocks held (most decodes): a request's hot path
            total = req.num_computed_tokens + num_new
            held = len(self.managers[0].req_to_blocks.get(rid, ()))  # num_held_blocks, inline
            if held and total <= held * self.block_size:
                self._req_tokens[rid] = total
                return []
        total, held, need = self._count(req, num_new, hit)
        if need > self.pool.num_free_blocks - self._reusable(hit):
            return None
        hit = hit or self._no_hit
        for blocks in hit:
            self.pool.touch(self._real(blocks))
        new = self.pool.get_new_blocks(need)
        news = [new] if G == 1 else [new[k::G] for k in range(G)]
        for m, hit_blocks, new_blocks in zip(self.managers, hit, news):
            blocks = m.req_to_blocks.setdefault(rid, [])
            blocks += hit_blocks
            blocks += new_blocks
        self._req_tokens[rid] = total
        return flat_block_ids(hit) + flat_block_ids(news)

    def _count_like(self, req: Request, layout: Layout, num_new: int) -> tuple[int, int, int]:
        """For `layout` plus `num_new` more tokens: the tokens the request then holds, the
        logical blocks past the layout's, and the free blocks that takes."""
        total = req.num_computed_tokens + num_new
        more = max(cdiv(total, self.block_size) - len(layout[0]), 0)
        real = sum(x is not None for row in layout for x in row)
        return total, more, real + more * self.num_groups

    def blocks_needed_like(self, req: Request, layout: Layout, num_new: int) -> int:
        """Free blocks `allocate_like` would take."""
        return self._count_like(req, layout, num_new)[2]

    def allocate_like(self, req: Request, layout: Layout, num_new: int) -> PerGroup | None:
        """Blocks for a request with none, shaped as `layout` (per group, None where the null
        block goes), plus room for `num_new` more tokens after its computed ones; None when
        free blocks are short. Taken in the order of `flat_block_ids`."""
        G, held = self.num_groups, len(layout[0])
        total, more, need = self._count_like(req, layout, num_new)
        if need > self.pool.num_free_blocks:
            return None
        new = iter(self.pool.get_new_blocks(need))
        blocks: list[list[KVBlock]] = [[] for _ in range(G)]
        for i in range(held + more):
            for k in range(G):
                none = i < held and layout[k][i] is None  # only where the null block was
                blocks[k].append(self.null_block if none and self.null_block else next(new))
        for m, b in zip(self.managers, blocks):
            m.req_to_blocks[req.request_id] = b
        self._req_tokens[req.request_id] = total
        return blocks

    def free(self, req_id: str) -> None:
        blocks = [m.free(req_id) or [] for m in self.managers]
        self._num_indexed.pop(req_id, None)
        self._req_tokens.pop(req_id, None)
        if blocks[0]:
            self.pool.free_blocks(self.tail_first(blocks))

    def tail_first(self, blocks: PerGroup) -> list[KVBlock]:
        """The real blocks of a request's lists, last logical block first (freed in this order,
        tails are evicted first)."""
        if len(blocks) == 1:
            return self._real(blocks[0][::-1])
        return self._real([b for row in reversed(list(zip(*blocks))) for b in reversed(row)])

    def _real(self, blocks: list[KVBlock]) -> list[KVBlock]:
        null = self.null_block
        return blocks if null is None else [b for b in blocks if b is not null]

    # ---- figures ------------------------------------------------------------------
    def token_room(self, req: Request, free_blocks: int) -> int:
        """Tokens past the request's computed ones that its blocks plus `free_blocks` more hold."""
        held = self.num_held_blocks(req.request_id) + max(free_blocks, 0) // self.num_groups
        return held * self.block_size - req.num_computed_tokens

    def token_capacity(self, max_chunk: int) -> int:
        """The longest request the pool can hold alone, prefilled in chunks of at most `max_chunk`
        tokens: a sliding group holds at most its window plus one chunk at a time."""
        G, bs, usable = self.num_groups, self.block_size, self.num_blocks
        if not self._sliding:
            return usable // G * bs
        # logical blocks a sliding group holds
        span = max(cdiv(m.window - 1 + max_chunk, bs) + 1 for m in self._sliding)
        if G * span >= usable:
            return usable // G * bs  # the pool runs out before any window frees a block
        if not self._full:
            return 1 << 40  # every layer windowed: any length fits
        return (span + (usable - G * span) // len(self._full)) * bs

    def num_cached_blocks(self, req: Request) -> int:
        """The request's logical blocks whose first full group's block sits in the prefix index
        (they survive a recompute preemption)."""
        m = self._full[0] if self._full else self.managers[0]
        return sum(1 for b in m.req_to_blocks.get(req.request_id, ()) if b.block_hash is not None)

    @property
    def utilization(self) -> float:
        """Tokens stored / token capacity of the blocks held: internal fragmentation (a block
        behind a sliding window counts as held)."""
        held = sum(len(b) for m in self.managers for b in m.req_to_blocks.values())
        if not held:
            return 1.0
        return sum(self._req_tokens.values()) * self.num_groups / (held * self.block_size)
