"""BlockPool and KVCacheManager: free list, ref counts, LRU eviction, prefix index, slots.

Torch-free by intent: only `tandem.core.*` is used (see test_core_import_is_torch_free).
"""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from tandem.core.block_pool import BlockPool, hash_block
from tandem.core.kv_cache_coordinator import cdiv
from tandem.core.kv_cache_manager import KVCacheManager
from tandem.core.request import Request
from tandem.core.sampling_params import SamplingParams


def make_req(rid: str, tokens: list[int], **kw) -> Request:
    return Request(rid, list(tokens), SamplingParams(max_tokens=kw.pop("max_tokens", 16)), **kw)


def check_pool(pool: BlockPool) -> None:
    """Structural invariants that need no model."""
    free_ids = list(pool._free)
    evict_ids = list(pool._evictable)
    owned_ids = [b.block_id for b in pool.blocks if b.ref_cnt > 0]
    assert len(free_ids) == len(set(free_ids)), "block id twice in the free list"
    assert set(free_ids).isdisjoint(evict_ids)
    assert set(free_ids).isdisjoint(owned_ids) and set(evict_ids).isdisjoint(owned_ids)
    assert len(free_ids) + len(evict_ids) + len(owned_ids) == pool.num_blocks
    assert pool.num_free_blocks + len(owned_ids) == pool.num_blocks
    for b in pool.blocks:
        assert b.ref_cnt >= 0
        assert b.block_id == pool.blocks.index(b)
    for bid in free_ids:
        assert pool.blocks[bid].ref_cnt == 0 and pool.blocks[bid].block_hash is None
    for bid, blk in pool._evictable.items():
        assert blk is pool.blocks[bid] and blk.ref_cnt == 0 and blk.block_hash is not None
    for h, blk in pool._cached.items():
        assert blk.block_hash == h and blk.token_ids is not None
    indexed = {id(b) for b in pool._cached.values()}
    for b in pool.blocks:  # a block carries a hash iff it is in the index
        assert (b.block_hash is not None) == (id(b) in indexed)
        assert (b.token_ids is not None) == (b.block_hash is not None)
    assert pool.num_cached_blocks == len(pool._cached)


# =====================================================================================
# BlockPool unit tests
# =====================================================================================


def test_new_pool_is_all_free():
    pool = BlockPool(5)
    assert pool.num_blocks == 5 and pool.num_free_blocks == 5 and pool.num_cached_blocks == 0
    check_pool(pool)


@pytest.mark.parametrize("n", [0, -1])
def test_pool_needs_a_block(n):
    with pytest.raises(ValueError):
        BlockPool(n)


def test_get_new_blocks_owns_distinct_blocks():
    pool = BlockPool(4)
    blocks = pool.get_new_blocks(3)
    assert len({b.block_id for b in blocks}) == 3
    assert all(b.ref_cnt == 1 and b.block_hash is None for b in blocks)
    assert pool.num_free_blocks == 1
    assert pool.get_new_blocks(0) == []
    check_pool(pool)


def test_get_new_blocks_over_ask_raises_and_changes_nothing():
    pool = BlockPool(3)
    pool.get_new_blocks(2)
    with pytest.raises(RuntimeError):
        pool.get_new_blocks(2)
    assert pool.num_free_blocks == 1
    check_pool(pool)


def test_free_returns_blocks_and_double_free_raises():
    pool = BlockPool(3)
    blocks = pool.get_new_blocks(2)
    pool.free_blocks(blocks)
    assert pool.num_free_blocks == 3
    with pytest.raises(RuntimeError):
        pool.free_blocks(blocks[:1])


def test_free_below_zero_leaves_pool_consistent():
    """A refused free must not leave a negative ref count behind (else a later touch of
    an evictable block leaves it owned *and* in the LRU, and it gets evicted under its owner)."""
    pool = BlockPool(2)
    (b,) = pool.get_new_blocks(1)
    pool.cache_block(b, hash_block(None, (1, 2)), (1, 2))
    pool.free_blocks([b])  # now cached and evictable
    with pytest.raises(RuntimeError):
        pool.free_blocks([b])
    assert b.ref_cnt == 0
    check_pool(pool)
    # The damage, if the count went to -1: touch takes it to 0 but leaves it in the LRU.
    pool.touch([pool.lookup(hash_block(None, (1, 2)), (1, 2))])
    assert b.ref_cnt == 1 and b.block_id not in pool._evictable


def test_shared_block_is_free_only_after_last_owner():
    pool = BlockPool(2)
    (b,) = pool.get_new_blocks(1)
    pool.cache_block(b, 7, (1,))
    pool.touch([b])
    assert b.ref_cnt == 2
    pool.free_blocks([b])
    assert b.ref_cnt == 1 and pool.num_free_blocks == 1
    pool.free_blocks([b])
    assert b.ref_cnt == 0 and pool.num_free_blocks == 2
    check_pool(pool)


def _cached_unowned(pool: BlockPool, n: int, base: int = 100):
    """Allocate n blocks, index each, free them in order: LRU order = allocation order."""
    blocks = pool.get_new_blocks(n)
    keys = []
    for i, b in enumerate(blocks):
        toks = (base + i,)
        h = hash_block(None, toks)
        pool.cache_block(b, h, toks)
        keys.append((h, toks))
    for b in blocks:
        pool.free_blocks([b])
    return blocks, keys


def test_cached_unowned_blocks_count_as_free_and_stay_hittable():
    pool = BlockPool(4)
    blocks, keys = _cached_unowned(pool, 2)
    assert pool.num_free_blocks == 4 and pool.num_cached_blocks == 2
    for b, (h, toks) in zip(blocks, keys):
        assert pool.lookup(h, toks) is b
    check_pool(pool)


def test_plain_free_blocks_are_taken_before_evicting():
    pool = BlockPool(4)
    blocks, keys = _cached_unowned(pool, 2)
    new = pool.get_new_blocks(2)
    assert {b.block_id for b in new}.isdisjoint(b.block_id for b in blocks)
    assert pool.num_evictions == 0 and pool.num_cached_blocks == 2
    check_pool(pool)


def test_eviction_is_lru_least_recently_freed_first():
    pool = BlockPool(3)
    blocks = pool.get_new_blocks(3)
    keys = []
    for i, b in enumerate(blocks):
        keys.append((hash_block(None, (i,)), (i,)))
        pool.cache_block(b, *keys[-1])
    order = [2, 0, 1]  # free order: block 2 is least recently freed
    for i in order:
        pool.free_blocks([blocks[i]])
    # A hit refreshes nothing by itself, but touching + freeing moves it to the MRU end.
    pool.touch([blocks[2]])
    pool.free_blocks([blocks[2]])  # LRU is now 0, 1, 2
    (e1,) = pool.get_new_blocks(1)
    assert e1 is blocks[0] and pool.num_evictions == 1
    assert pool.lookup(*keys[0]) is None and e1.block_hash is None
    (e2,) = pool.get_new_blocks(1)
    assert e2 is blocks[1]
    assert pool.lookup(*keys[2]) is blocks[2]
    check_pool(pool)


def test_lookup_verifies_token_ids_not_only_the_hash():
    pool = BlockPool(2)
    (b,) = pool.get_new_blocks(1)
    pool.cache_block(b, 12345, (1, 2, 3))
    assert pool.lookup(12345, (1, 2, 3)) is b
    assert pool.lookup(12345, (1, 2, 4)) is None  # forged collision
    assert pool.lookup(54321, (1, 2, 3)) is None


def test_touch_takes_a_ref_and_pulls_from_lru():
    pool = BlockPool(2)
    blocks, keys = _cached_unowned(pool, 1)
    hit = pool.lookup(*keys[0])
    pool.touch([hit])
    assert hit.ref_cnt == 1 and pool.num_free_blocks == 1
    # It can no longer be evicted: only the plain free block is left.
    (other,) = pool.get_new_blocks(1)
    assert other is not hit
    with pytest.raises(RuntimeError):
        pool.get_new_blocks(1)
    assert pool.lookup(*keys[0]) is hit
    check_pool(pool)


def test_cache_block_duplicates_stay_unindexed():
    pool = BlockPool(3)
    a, b = pool.get_new_blocks(2)
    pool.cache_block(a, 1, (9,))
    pool.cache_block(b, 1, (9,))  # same content elsewhere: not indexed
    assert b.block_hash is None and pool.lookup(1, (9,)) is a
    pool.cache_block(a, 2, (8,))  # already indexed: keeps its first key
    assert a.block_hash == 1 and pool.lookup(2, (8,)) is None
    pool.free_blocks([a, b])
    assert b.block_id in pool._free and a.block_id in pool._evictable
    check_pool(pool)


def test_reset_prefix_cache_drops_unowned_entries_only():
    pool = BlockPool(4)
    blocks, keys = _cached_unowned(pool, 2)
    (owned,) = pool.get_new_blocks(1)
    pool.cache_block(owned, 99, (99,))
    pool.reset_prefix_cache()
    assert pool.lookup(*keys[0]) is None and pool.lookup(*keys[1]) is None
    assert pool.lookup(99, (99,)) is owned and owned.ref_cnt == 1
    assert pool.num_free_blocks == 3 and pool.num_cached_blocks == 1
    check_pool(pool)


def test_hash_block_chains_on_parent():
    h1 = hash_block(None, (1, 2))
    assert h1 == hash_block(None, (1, 2))
    assert hash_block(h1, (3, 4)) != hash_block(None, (3, 4))
    assert hash_block(h1, (3, 4)) != hash_block(hash_block(None, (1, 5)), (3, 4))


def test_hash_block_is_deterministic_across_processes():
    """The docstring promises instances and the router agree on prefix hashes. On
    Python < 3.12 hash(None) is address-based, so the root block's hash (parent None)
    and every hash chained on it differ from process to process."""
    # Load the module from its file so the child skips tandem/__init__ (and its torch import).
    import tandem.core.block_pool as bp

    code = (
        f"import sys, importlib.util as u; s = u.spec_from_file_location('bp', {bp.__file__!r}); "
        "m = sys.modules['bp'] = u.module_from_spec(s); s.loader.exec_module(m); "
        "h = m.hash_block; "
        "print(h(h(None, (1, 2, 3)), (4, 5, 6)))"
    )
    outs = {
        subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, check=True
        ).stdout.strip()
        for _ in range(3)
    }
    assert len(outs) == 1, f"hash_block differs across processes: {outs}"


def test_core_import_is_torch_free():
    """tandem.core claims to be torch-free (shared with the simulator), but importing any
    tandem.core module runs tandem/__init__.py, which imports tandem.engine.llm -> torch."""
    code = (
        "import sys; import tandem.core.scheduler, tandem.core.kv_cache_manager; "
        "print('torch' in sys.modules)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout.strip()
    assert out == "False", "importing tandem.core.* imports torch"


# =====================================================================================
# BlockPool state machine
# =====================================================================================


class BlockPoolMachine(RuleBasedStateMachine):
    """Model: owner references (lists of block ids), the evictable LRU order, the set of
    plain free blocks, and the prefix index (hash -> (block id, token ids))."""

    @initialize(num_blocks=st.integers(1, 10))
    def setup(self, num_blocks):
        self.pool = BlockPool(num_blocks)
        self.refs = [0] * num_blocks
        self.plain_free = set(range(num_blocks))
        self.lru: list[int] = []
        self.index: dict[int, tuple[int, tuple[int, ...]]] = {}
        self.live_owners: list[list[int]] = []

    def _block_hash(self, bid):
        for h, (b, _) in self.index.items():
            if b == bid:
                return h
        return None

    @rule(n=st.integers(0, 12))
    def allocate(self, n):
        before = self.pool.num_free_blocks
        if n > before:
            with pytest.raises(RuntimeError):
                self.pool.get_new_blocks(n)
            assert self.pool.num_free_blocks == before
            return
        blocks = self.pool.get_new_blocks(n)
        ids = [b.block_id for b in blocks]
        n_evict = max(0, n - len(self.plain_free))
        expect_evicted = self.lru[:n_evict]
        from_free = [i for i in ids if i not in expect_evicted]
        assert set(from_free) <= self.plain_free
        assert len(from_free) == n - n_evict
        # evicted ones come out in LRU order after the plain free ones
        assert [i for i in ids if i in expect_evicted] == expect_evicted
        self.lru = self.lru[n_evict:]
        self.plain_free -= set(from_free)
        for bid in expect_evicted:
            h = self._block_hash(bid)
            assert h is not None
            del self.index[h]
        for bid in ids:
            assert self.refs[bid] == 0
            self.refs[bid] = 1
        self.live_owners.append(list(ids))

    def _release(self, owner):
        self.pool.free_blocks([self.pool.blocks[i] for i in owner])
        for bid in owner:
            self.refs[bid] -= 1
            if self.refs[bid] == 0:
                if self._block_hash(bid) is None:
                    self.plain_free.add(bid)
                else:
                    self.lru.append(bid)
        self.live_owners.remove(owner)  # by identity of value: equal owners are interchangeable

    @precondition(lambda self: bool(self.live_owners))
    @rule(k=st.integers(0, 50))
    def free(self, k):
        self._release(self.live_owners[k % len(self.live_owners)])

    @precondition(lambda self: any(self.live_owners))
    @rule(
        k=st.integers(0, 50),
        pos=st.integers(0, 11),
        parent=st.sampled_from([None, 1, 2]),
        toks=st.lists(st.integers(0, 2), min_size=1, max_size=2).map(tuple),
    )
    def cache(self, k, pos, parent, toks):
        owners = [o for o in self.live_owners if o]
        owner = owners[k % len(owners)]
        bid = owner[pos % len(owner)]
        h = hash_block(parent, toks)
        self.pool.cache_block(self.pool.blocks[bid], h, toks)
        if self._block_hash(bid) is None and h not in self.index:
            self.index[h] = (bid, toks)

    @precondition(lambda self: bool(self.index))
    @rule(data=st.data())
    def hit(self, data):
        h = data.draw(st.sampled_from(sorted(self.index)))
        bid, toks = self.index[h]
        assert self.pool.lookup(h, toks + (7,)) is None  # token ids are verified
        block = self.pool.lookup(h, toks)
        assert block is not None and block.block_id == bid
        self.pool.touch([block])
        if self.refs[bid] == 0:
            self.lru.remove(bid)
        self.refs[bid] += 1
        self.live_owners.append([bid])

    @rule()
    def reset_prefix_cache(self):
        self.pool.reset_prefix_cache()
        for bid in self.lru:
            del self.index[self._block_hash(bid)]
            self.plain_free.add(bid)
        self.lru = []

    @invariant()
    def matches_model(self):
        pool = self.pool
        check_pool(pool)
        assert [b.ref_cnt for b in pool.blocks] == self.refs
        expect_refs = [0] * pool.num_blocks
        for owner in self.live_owners:
            for bid in owner:
                expect_refs[bid] += 1
        assert expect_refs == self.refs
        assert set(pool._free) == self.plain_free
        assert list(pool._evictable) == self.lru
        assert {h: (b.block_id, b.token_ids) for h, b in pool._cached.items()} == self.index
        owned = sum(1 for r in self.refs if r > 0)
        assert pool.num_free_blocks + owned == pool.num_blocks

    def teardown(self):
        if not hasattr(self, "pool"):
            return
        for owner in list(self.live_owners):
            self._release(owner)
        assert self.pool.num_free_blocks == self.pool.num_blocks
        check_pool(self.pool)


BlockPoolMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None
)
TestBlockPoolMachine = BlockPoolMachine.TestCase


# =====================================================================================
# KVCacheManager
# =====================================================================================


def run_prefill(kv: KVCacheManager, req: Request) -> list[int]:
    """Admit a request the way the scheduler does, compute all its tokens, index them."""
    blocks, hit = kv.get_computed_blocks(req)
    ids = kv.allocate_slots(req, req.num_tokens - hit, blocks)
    assert ids is not None
    req.num_cached_tokens = hit
    req.num_computed_tokens = req.num_tokens
    kv.cache_blocks(req)
    return ids


def test_allocate_slots_holds_ceil_blocks():
    kv = KVCacheManager(16, block_size=4)
    req = make_req("a", range(10))
    ids = kv.allocate_slots(req, 10)
    assert len(ids) == 3 and kv.block_ids(req) == ids
    req.num_computed_tokens = 10
    for step in range(1, 9):  # decode one token at a time
        req.all_token_ids.append(step)
        new = kv.allocate_slots(req, 1)
        assert new is not None
        req.num_computed_tokens += 1
        assert len(kv.block_ids(req)) == cdiv(req.num_computed_tokens, 4)
        assert len(new) == (1 if (req.num_computed_tokens - 1) % 4 == 0 else 0)
    assert kv.num_free_blocks == 16 - 5
    kv.free(req)
    assert kv.num_free_blocks == 16 and kv.block_ids(req) == []


def test_allocate_slots_none_changes_nothing():
    kv = KVCacheManager(3, block_size=4)
    a, b = make_req("a", range(8)), make_req("b", range(8))
    assert kv.allocate_slots(a, 8) is not None
    assert kv.allocate_slots(b, 8) is None
    assert kv.num_free_blocks == 1 and "b" not in kv.coordinator.managers[0].req_to_blocks
    # a running request asking too much keeps what it had
    a.num_computed_tokens = 8
    held = kv.block_ids(a)
    assert kv.allocate_slots(a, 9) is None
    assert kv.block_ids(a) == held and kv.num_free_blocks == 1


def test_free_returns_tail_first_so_tails_are_evicted_first():
    kv = KVCacheManager(4, block_size=2)
    req = make_req("a", range(8))
    ids = run_prefill(kv, req)
    assert len(ids) == 4
    kv.free(req)
    assert list(kv.pool._evictable) == list(reversed(ids))
    check_pool(kv.pool)


def test_get_computed_blocks_longest_full_block_prefix():
    kv = KVCacheManager(32, block_size=4)
    a = make_req("a", range(14))
    a_ids = run_prefill(kv, a)
    assert kv.pool.num_cached_blocks == 3  # 12 of 14 tokens in full blocks
    # same first 9 tokens: 2 full blocks match
    b = make_req("b", list(range(9)) + [99] * 6)
    blocks, hit = kv.get_computed_blocks(b)
    assert hit == 8 and [x.block_id for x in blocks[0]] == a_ids[:2]
    # different first token: nothing
    c = make_req("c", [99] + list(range(1, 14)))
    assert kv.get_computed_blocks(c) == ((), 0)


def test_a_requests_blocks_are_hashed_once_however_often_its_admission_is_tried(monkeypatch):
    """A waiting request's admission is tried every step until it fits: its block hashes are
    computed on the first try and kept on the request, through indexing, a recompute
    preemption and its admission again."""
    from tandem.core import kv_cache_coordinator

    hashed = []
    real = kv_cache_coordinator.hash_block

    def counted(parent, token_ids):
        hashed.append(token_ids)
        return real(parent, token_ids)

    monkeypatch.setattr(kv_cache_coordinator, "hash_block", counted)
    kv = KVCacheManager(8, block_size=4)
    run_prefill(kv, make_req("a", range(12)))
    hashed.clear()
    b = make_req("b", list(range(12)) + [50] * 5)  # four whole blocks, three of them a's
    first = kv.get_computed_blocks(b)
    assert first[1] == 12 and len(hashed) == 4
    for _ in range(3):
        assert kv.get_computed_blocks(b) == first
    ids = kv.allocate_slots(b, b.num_tokens - 12, first[0])
    assert ids is not None
    b.num_computed_tokens = b.num_tokens
    kv.cache_blocks(b)
    kv.free(b)  # preempted, to recompute: its tokens are the same
    b.num_computed_tokens = 0
    assert kv.get_computed_blocks(b)[1] == 16  # its own fourth block too
    assert len(hashed) == 4 and len(b.block_hashes) == 4
    check_pool(kv.pool)


def test_the_cache_salt_roots_the_hash_chain():
    """A prefix cached under one salt (a precision variant, a LoRA adapter) is served under the
    same salt only."""
    kv = KVCacheManager(8, block_size=4)
    run_prefill(kv, make_req("a", range(9), cache_salt="int8"))
    assert kv.get_computed_blocks(make_req("b", range(9), cache_salt="int8"))[1] == 8
    assert kv.get_computed_blocks(make_req("c", range(9), cache_salt="int4"))[1] == 0
    assert kv.get_computed_blocks(make_req("d", range(9)))[1] == 0


def test_get_computed_blocks_never_the_whole_prompt():
    kv = KVCacheManager(32, block_size=4)
    run_prefill(kv, make_req("a", range(12)))
    blocks, hit = kv.get_computed_blocks(make_req("b", range(12)))
    assert hit == 8 and len(blocks[0]) == 2  # 12 tokens cached, 1 must be left: 2 blocks
    blocks, hit = kv.get_computed_blocks(make_req("c", range(13)))
    assert hit == 12
    blocks, hit = kv.get_computed_blocks(make_req("d", range(4)))
    assert hit == 0


def test_get_computed_blocks_max_prefix_and_min_match():
    kv = KVCacheManager(32, block_size=4, max_prefix_tokens=6)
    run_prefill(kv, make_req("a", range(20)))
    assert kv.pool.num_cached_blocks == 1  # only 6 tokens indexable: 1 full block
    assert kv.get_computed_blocks(make_req("b", range(20)))[1] == 4

    kv = KVCacheManager(32, block_size=4, min_match_length=9)
    run_prefill(kv, make_req("a", range(20)))
    assert kv.get_computed_blocks(make_req("b", list(range(8)) + [99] * 5))[1] == 0
    assert kv.get_computed_blocks(make_req("c", list(range(12)) + [99]))[1] == 12

    kv = KVCacheManager(32, block_size=4, enable_caching=False)
    run_prefill(kv, make_req("a", range(20)))
    assert kv.pool.num_cached_blocks == 0
    assert kv.get_computed_blocks(make_req("b", range(20))) == ((), 0)


def test_cache_blocks_indexes_full_computed_blocks_only():
    kv = KVCacheManager(32, block_size=4)
    req = make_req("a", range(11))
    kv.allocate_slots(req, 6)
    req.num_computed_tokens = 6
    kv.cache_blocks(req)
    assert kv.pool.num_cached_blocks == 1
    kv.allocate_slots(req, 5)
    req.num_computed_tokens = 11
    kv.cache_blocks(req)
    assert kv.pool.num_cached_blocks == 2
    assert kv.get_computed_blocks(make_req("b", range(11)))[1] == 8


def test_allocate_with_hits_from_the_lru_counts_them_as_taken():
    """4 blocks: a's 2 cached blocks are unowned in the LRU. b hits both and needs 2
    more; 4 free - 2 reusable = 2, so it fits exactly and must not evict its own hits."""
    kv = KVCacheManager(4, block_size=4)
    a = make_req("a", range(8))
    run_prefill(kv, a)
    kv.free(a)
    b = make_req("b", list(range(8)) + [50] * 6)
    blocks, hit = kv.get_computed_blocks(b)
    assert hit == 8
    ids = kv.allocate_slots(b, b.num_tokens - hit, blocks)
    assert ids is not None and len(ids) == 4 and len(set(ids)) == 4
    assert all(kv.pool.blocks[i].ref_cnt == 1 for i in ids)
    check_pool(kv.pool)
    c = make_req("c", list(range(8)) + [60] * 10)
    blocks, hit = kv.get_computed_blocks(c)  # hits are owned by b now
    assert hit == 8
    kv.free(b)
    blocks, hit = kv.get_computed_blocks(c)
    # c needs 3 new blocks beyond its 2 hits: 4 free - 2 reusable = 2 < 3
    assert kv.allocate_slots(c, c.num_tokens - hit, blocks) is None
    assert kv.num_free_blocks == 4 and all(x.ref_cnt == 0 for x in blocks[0])
    check_pool(kv.pool)


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_kv_manager_random_ops_keep_figures_in_range(data):
    bs = data.draw(st.sampled_from([1, 2, 4]))
    num_blocks = data.draw(st.integers(1, 12))
    kv = KVCacheManager(num_blocks, block_size=bs)
    prefixes = [list(range(6)), [7] * 6]
    live: dict[str, Request] = {}
    for i in range(data.draw(st.integers(1, 25))):
        op = data.draw(st.sampled_from(["new", "grow", "free"]))
        if op == "new":
            toks = data.draw(st.sampled_from(prefixes))[: data.draw(st.integers(0, 6))]
            toks = toks + data.draw(st.lists(st.integers(0, 3), max_size=6))
            if not toks:
                continue
            req = make_req(f"r{i}", toks)
            blocks, hit = kv.get_computed_blocks(req)
            assert hit % bs == 0 and hit < req.num_tokens
            before = kv.num_free_blocks
            ids = kv.allocate_slots(req, req.num_tokens - hit, blocks)
            if ids is None:
                assert kv.num_free_blocks == before
                assert req.request_id not in kv.coordinator.managers[0].req_to_blocks
                continue
            req.num_computed_tokens = req.num_tokens
            kv.cache_blocks(req)
            live[req.request_id] = req
        elif op == "grow" and live:
            req = live[data.draw(st.sampled_from(sorted(live)))]
            req.all_token_ids.append(data.draw(st.integers(0, 3)))
            held = kv.block_ids(req)
            if kv.allocate_slots(req, 1) is None:
                assert kv.block_ids(req) == held
                req.all_token_ids.pop()
                continue
            req.num_computed_tokens += 1
            kv.cache_blocks(req)
        elif op == "free" and live:
            kv.free(live.pop(data.draw(st.sampled_from(sorted(live)))))
        for req in live.values():
            assert len(kv.block_ids(req)) == math.ceil(req.num_computed_tokens / bs)
        check_pool(kv.pool)
        refs = [0] * num_blocks
        for blocks in kv.coordinator.managers[0].req_to_blocks.values():
            assert len({b.block_id for b in blocks}) == len(blocks)
            for b in blocks:
                refs[b.block_id] += 1
        assert refs == [b.ref_cnt for b in kv.pool.blocks]
        assert 0.0 <= kv.usage <= 1.0 and 0.0 <= kv.utilization <= 1.0
        assert 0.0 <= kv.stats.hit_rate <= 1.0
    for req in live.values():
        kv.free(req)
    assert kv.num_free_blocks == num_blocks and kv.usage == 0.0
