"""Scheduler: continuous batching, chunked prefill, preemption, prefix reuse, aborts.

Driven without a model: a fake executor samples one token for every scheduled request
whose prefill has caught up (num_computed_tokens == num_tokens after schedule). The token
is a deterministic function of the request id and its length, so runs can be compared.
"""
from __future__ import annotations

import zlib

import pytest
from hypothesis import event, given, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from tandem.core.kv_cache_manager import KVCacheManager, cdiv
from tandem.core.outputs import ModelRunnerOutput, SchedulerOutput
from tandem.core.request import Request, RequestStatus
from tandem.core.sampling_params import SamplingParams
from tandem.core.scheduler import Scheduler, SchedulerConfig

EOS = 0


def fake_token(req_id: str, length: int, vocab: int = 50) -> int:
    """Deterministic in (id, length); EOS (0) now and then."""
    return zlib.crc32(f"{req_id}/{length}".encode()) % vocab


def make_sched(num_blocks=64, block_size=4, max_num_seqs=8, max_num_batched_tokens=64,
               max_model_len=None, **kv_kw) -> Scheduler:
    kv = KVCacheManager(num_blocks, block_size=block_size, **kv_kw)
    max_model_len = max_model_len or min(128, num_blocks * block_size)
    cfg = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                          max_model_len=max_model_len)
    return Scheduler(cfg, kv, clock=lambda: 0.0)


def make_req(rid, tokens, max_tokens=4, eos=None, **kw) -> Request:
    return Request(rid, list(tokens), SamplingParams(max_tokens=max_tokens), eos_token_id=eos, **kw)


class FakeExecutor:
    """Mirrors the executor's view (block tables, computed positions) from the scheduler
    outputs alone, checks them against the scheduler, and samples fake tokens."""

    def __init__(self, sched: Scheduler, vocab: int = 50) -> None:
        self.sched = sched
        self.vocab = vocab
        self.tables: dict[str, list[int]] = {}
        self.positions: dict[str, int] = {}

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        s = self.sched
        for rid in out.finished_req_ids | out.preempted_req_ids:
            self.tables.pop(rid, None)
            self.positions.pop(rid, None)
        ids_new = [r.req_id for r in out.scheduled_new_reqs]
        ids_cached = [r.req_id for r in out.scheduled_cached_reqs]
        assert len(set(ids_new + ids_cached)) == len(ids_new) + len(ids_cached)
        assert set(ids_new + ids_cached) == set(out.num_scheduled_tokens)
        assert not set(out.num_scheduled_tokens) & out.preempted_req_ids
        assert out.total_num_scheduled_tokens == sum(out.num_scheduled_tokens.values())
        for r in out.scheduled_new_reqs:
            assert r.req_id not in self.tables, "new request the executor already holds"
            self.tables[r.req_id] = list(r.block_ids)
            self.positions[r.req_id] = r.num_computed_tokens
        for r in out.scheduled_cached_reqs:
            assert r.req_id in self.tables, "cached request the executor dropped"
            assert self.positions[r.req_id] == r.num_computed_tokens, "gap or overlap in KV"
            self.tables[r.req_id].extend(r.new_block_ids)
        sampled = {}
        for rid, n in out.num_scheduled_tokens.items():
            self.positions[rid] += n
            req = s.requests.get(rid)
            if req is None:  # aborted between schedule and execute
                continue
            assert self.positions[rid] == req.num_computed_tokens
            assert self.tables[rid] == s.kv.block_ids(req), "executor block table diverged"
            assert len(self.tables[rid]) * s.kv.block_size >= req.num_computed_tokens
            if n > 0 and req.num_computed_tokens == req.num_tokens:
                sampled[rid] = [fake_token(rid, req.num_tokens, self.vocab)]
        return ModelRunnerOutput(sampled_token_ids=sampled)


class Driver:
    def __init__(self, sched: Scheduler, vocab: int = 50) -> None:
        self.sched = sched
        self.ex = FakeExecutor(sched, vocab)
        self.tokens: dict[str, list[int]] = {}
        self.finish: dict[str, str | None] = {}
        self.outputs: list[SchedulerOutput] = []
        self.pending_finished: set[str] = set()

    def add(self, req: Request) -> Request:
        self.sched.add_request(req)
        self.tokens[req.request_id] = []
        return req

    def schedule(self) -> SchedulerOutput:
        out = self.sched.schedule()
        check_step(self.sched, out)
        assert out.finished_req_ids == self.pending_finished
        self.pending_finished = set()
        self.outputs.append(out)
        return out

    def finish_step(self, out: SchedulerOutput):
        res = self.ex.execute(out)
        before = set(self.sched.requests)
        core = self.sched.update_from_output(out, res)
        for o in core:
            self.tokens[o.req_id].extend(o.new_token_ids)
            if o.finish_reason is not None:
                self.finish[o.req_id] = o.finish_reason
        self.pending_finished |= before - set(self.sched.requests)
        check_ownership(self.sched)
        return core

    def step(self) -> SchedulerOutput:
        out = self.schedule()
        self.finish_step(out)
        return out

    def abort(self, rids):
        before = set(self.sched.requests)
        self.sched.finish_requests(list(rids), RequestStatus.FINISHED_ABORTED)
        gone = before - set(self.sched.requests)
        for rid in gone:
            self.finish[rid] = "abort"
        self.pending_finished |= gone
        check_ownership(self.sched)

    def run(self, max_steps=10_000) -> int:
        steps = 0
        while self.sched.num_unfinished:
            self.step()
            steps += 1
            assert steps < max_steps, "no progress"
        return steps


def check_step(sched: Scheduler, out: SchedulerOutput) -> None:
    cfg = sched.config
    assert 0 <= out.total_num_scheduled_tokens <= cfg.max_num_batched_tokens
    assert sum(out.num_scheduled_tokens.values()) == out.total_num_scheduled_tokens
    assert len(sched.running) <= cfg.max_num_seqs
    for rid in out.preempted_req_ids:
        req = sched.requests[rid]
        assert req.status == RequestStatus.PREEMPTED and req.num_computed_tokens == 0
        assert req in sched.waiting and rid not in sched.kv.req_to_blocks
    check_ownership(sched)


def check_ownership(sched: Scheduler) -> None:
    kv, pool = sched.kv, sched.kv.pool
    running_ids = {r.request_id for r in sched.running}
    assert len(running_ids) == len(sched.running)
    waiting_ids = {r.request_id for r in sched.waiting}
    assert len(waiting_ids) == len(sched.waiting)
    assert not running_ids & waiting_ids
    assert running_ids | waiting_ids == set(sched.requests)
    assert all(r.status == RequestStatus.RUNNING for r in sched.running)
    assert all(r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED) for r in sched.waiting)
    # only running requests own blocks
    assert set(kv.req_to_blocks) <= running_ids
    refs = [0] * pool.num_blocks
    for rid, blocks in kv.req_to_blocks.items():
        ids = [b.block_id for b in blocks]
        assert len(ids) == len(set(ids)), f"{rid} owns a block twice"
        for i in ids:
            refs[i] += 1
    assert refs == [b.ref_cnt for b in pool.blocks]
    for r in sched.running:
        assert len(kv.block_ids(r)) == cdiv(r.num_computed_tokens, kv.block_size)
        assert r.num_computed_tokens <= r.num_tokens
    owned = sum(1 for x in refs if x)
    assert kv.num_free_blocks + owned == pool.num_blocks
    assert sorted(pool._free) == sorted(set(pool._free))
    for b in pool.blocks:
        if b.ref_cnt == 0:  # free: either plain or cached-and-evictable
            assert (b.block_id in pool._evictable) == (b.block_hash is not None)
            assert (b.block_id in pool._free) == (b.block_hash is None)
    assert 0.0 <= kv.usage <= 1.0 and 0.0 <= kv.utilization <= 1.0


# =====================================================================================
# add_request
# =====================================================================================

def test_add_request_rejects_empty_and_too_long_prompts():
    s = make_sched(max_model_len=16)
    with pytest.raises(ValueError):
        s.add_request(make_req("e", []))
    with pytest.raises(ValueError):
        s.add_request(make_req("l", range(16)))
    assert not s.requests and not s.waiting
    s.add_request(make_req("ok", range(15), max_tokens=100))
    assert s.requests["ok"].max_tokens == 1  # room left in the context


def test_add_request_rejects_duplicate_ids():
    s = make_sched()
    s.add_request(make_req("a", [1, 2]))
    with pytest.raises(ValueError):
        s.add_request(make_req("a", [3, 4]))
    assert len(s.waiting) == 1 and s.requests["a"].prompt_token_ids == [1, 2]


def test_id_can_be_reused_after_finishing():
    s = make_sched()
    d = Driver(s)
    d.add(make_req("a", [1, 2, 3], max_tokens=1))
    d.run()
    d.add(make_req("a", [1, 2, 3], max_tokens=1))
    d.run()


# =====================================================================================
# budget, chunking, seq cap
# =====================================================================================

def test_long_prompt_is_chunked_across_steps():
    s = make_sched(max_num_batched_tokens=4, block_size=4)
    d = Driver(s)
    req = d.add(make_req("a", range(1, 11), max_tokens=2))
    out = d.step()
    assert out.num_scheduled_tokens == {"a": 4} and d.tokens["a"] == []
    assert [r.num_computed_tokens for r in out.scheduled_new_reqs] == [0]
    out = d.step()
    assert out.num_scheduled_tokens == {"a": 4} and d.tokens["a"] == []
    assert out.scheduled_cached_reqs[0].num_computed_tokens == 4
    out = d.step()
    assert out.num_scheduled_tokens == {"a": 2} and len(d.tokens["a"]) == 1
    out = d.step()
    assert out.num_scheduled_tokens == {"a": 1}
    assert d.finish["a"] == "length" and req.status == RequestStatus.FINISHED_LENGTH
    assert d.step().finished_req_ids == {"a"}


def test_decodes_go_first_and_prefills_share_the_leftover_budget():
    s = make_sched(max_num_batched_tokens=6)
    d = Driver(s)
    d.add(make_req("a", range(1, 4), max_tokens=10))
    d.step()  # a: 3-token prefill
    d.add(make_req("b", range(1, 21), max_tokens=1))
    out = d.step()
    assert out.num_scheduled_tokens == {"a": 1, "b": 5}
    out = d.step()
    assert out.num_scheduled_tokens == {"a": 1, "b": 5}


def test_max_num_seqs_caps_running():
    s = make_sched(max_num_seqs=2)
    d = Driver(s)
    for r in "abc":
        d.add(make_req(r, [1, 2, 3], max_tokens=3))
    out = d.step()
    assert set(out.num_scheduled_tokens) == {"a", "b"} and [r.request_id for r in s.waiting] == ["c"]
    d.step()
    d.step()  # a and b finish here
    out = d.step()
    assert set(out.num_scheduled_tokens) == {"c"} and out.finished_req_ids == {"a", "b"}
    d.run()
    assert d.finish == {"a": "length", "b": "length", "c": "length"}


def test_requests_that_do_not_fit_wait():
    s = make_sched(num_blocks=4, block_size=4)
    d = Driver(s)
    d.add(make_req("a", range(1, 13), max_tokens=1))  # 3 blocks
    d.add(make_req("b", range(21, 29), max_tokens=1))  # 2 blocks: only 1 left
    out = d.step()
    assert set(out.num_scheduled_tokens) == {"a"} and [r.request_id for r in s.waiting] == ["b"]
    out = d.step()  # a finished: b now fits (a's blocks are evictable)
    assert set(out.num_scheduled_tokens) == {"b"}
    d.run()
    assert s.kv.num_free_blocks == 4


def test_finished_request_frees_blocks_at_once():
    s = make_sched(num_blocks=8, enable_caching=False)
    d = Driver(s)
    d.add(make_req("a", range(1, 10), max_tokens=1))
    out = d.schedule()
    assert s.kv.num_free_blocks == 8 - 3
    d.finish_step(out)
    assert s.kv.num_free_blocks == 8 and "a" not in s.requests and not s.running
    assert d.schedule().finished_req_ids == {"a"}


def test_eos_stops_a_request():
    s = make_sched()
    d = Driver(s)
    rid = next(f"r{i}" for i in range(1000) if fake_token(f"r{i}", 3) == EOS)
    d.add(make_req(rid, [1, 2, 3], max_tokens=10, eos=EOS))
    d.run()
    assert d.tokens[rid] == [EOS] and d.finish[rid] == "stop"


# =====================================================================================
# preemption
# =====================================================================================

def test_preempts_most_recent_and_it_resumes_first():
    s = make_sched(num_blocks=4, block_size=4)
    d = Driver(s)
    for r in "abc":
        d.add(make_req(r, [1, 2, 3, 4], max_tokens=6))
    out = d.step()  # each holds 1 block, 1 left
    assert set(out.num_scheduled_tokens) == {"a", "b", "c"}
    d.add(make_req("d", [5, 6], max_tokens=1))  # arrives later: must wait behind c
    out = d.schedule()  # a takes the last block; b needs one: c (last admitted) goes
    assert out.preempted_req_ids == {"c"}
    c = s.requests["c"]
    assert c.status == RequestStatus.PREEMPTED and c.num_computed_tokens == 0
    assert c.num_preemptions == 1 and s.num_preemptions == 1
    assert [r.request_id for r in s.waiting] == ["c", "d"]
    assert set(out.num_scheduled_tokens) == {"a", "b"}  # no admission while memory is short
    d.finish_step(out)
    d.run()
    assert d.finish == {r: "length" for r in "abcd"}
    # c resumed before d was admitted
    first_sched = {}
    for i, o in enumerate(d.outputs):
        for r in o.scheduled_new_reqs:
            first_sched.setdefault(r.req_id, []).append(i)
    assert first_sched["c"][1] <= first_sched["d"][0]
    assert s.kv.num_free_blocks == 4 and not s.requests


def test_multiple_preemptions_resume_in_admission_order():
    s = make_sched(num_blocks=4, block_size=2, max_num_batched_tokens=64)
    d = Driver(s)
    d.add(make_req("a", [1, 2, 3], max_tokens=5))  # 2 blocks
    d.add(make_req("b", [4], max_tokens=1))  # 1 block
    d.add(make_req("c", [5], max_tokens=1))  # 1 block
    d.step()
    # b and c finish immediately; re-add two long-lived ones after a
    d.add(make_req("x", [7], max_tokens=5))
    d.add(make_req("y", [8], max_tokens=5))
    out = d.step()
    assert set(out.num_scheduled_tokens) == {"a", "x", "y"}
    preempted = []
    while s.num_unfinished:
        out = d.step()
        preempted.append(sorted(out.preempted_req_ids))
        if out.preempted_req_ids == {"x", "y"}:
            assert [r.request_id for r in list(s.waiting)[:2]] == ["x", "y"]
    assert any(preempted), "scenario should preempt"
    assert set(d.finish.values()) == {"length"}


def test_preempted_request_recomputes_from_prefix_cache():
    s = make_sched(num_blocks=5, block_size=4)
    d = Driver(s)
    d.add(make_req("a", range(1, 9), max_tokens=8))  # 2 blocks -> 4
    d.add(make_req("b", range(11, 19), max_tokens=8))  # 2 blocks
    while not any(o.preempted_req_ids for o in d.outputs):
        d.step()
    b = s.requests["b"]
    assert b.status == RequestStatus.PREEMPTED
    while b.status != RequestStatus.RUNNING:
        out = d.schedule()
        if b.status != RequestStatus.RUNNING:
            d.finish_step(out)
    (new,) = [r for r in out.scheduled_new_reqs if r.req_id == "b"]
    assert new.num_computed_tokens > 0  # its own blocks, still cached, were hit
    assert new.output_token_ids == d.tokens["b"] and d.tokens["b"]
    assert new.block_ids == s.kv.block_ids(b)
    d.finish_step(out)
    d.run()


def test_output_is_the_same_with_and_without_preemption():
    def run(num_blocks):
        s = make_sched(num_blocks=num_blocks, block_size=2)
        d = Driver(s)
        for i in range(4):
            d.add(make_req(f"r{i}", [i + 1] * 5, max_tokens=12))
        d.run()
        return d.tokens, s.num_preemptions

    big, p0 = run(100)
    small, p1 = run(9)
    assert p0 == 0 and p1 > 0
    assert big == small


# =====================================================================================
# prefix cache, siblings
# =====================================================================================

def test_second_identical_prompt_hits_the_prefix_cache():
    s = make_sched(block_size=4)
    d = Driver(s)
    prompt = list(range(1, 11))
    d.add(make_req("a", prompt, max_tokens=5))
    d.step()
    b = d.add(make_req("b", prompt, max_tokens=5))
    out = d.schedule()
    (new,) = out.scheduled_new_reqs
    assert new.req_id == "b" and new.num_computed_tokens == 8 and b.num_cached_tokens == 8
    assert out.num_scheduled_tokens["b"] == 2
    a_ids, b_ids = s.kv.block_ids(s.requests["a"]), s.kv.block_ids(b)
    assert a_ids[:2] == b_ids[:2] and a_ids[2] != b_ids[2]
    assert [s.kv.pool.blocks[i].ref_cnt for i in b_ids[:2]] == [2, 2]
    d.finish_step(out)
    d.run()
    assert s.kv.stats.requests == 2 and s.kv.stats.requests_hit == 1
    assert s.kv.stats.hits == 8 and s.kv.stats.queries == 20


def test_prefix_stats_count_each_request_once_even_when_admission_is_retried():
    """b cannot be admitted for a few steps; every failed try re-runs get_computed_blocks
    with num_cached_tokens still -1, so the stats count b again each time."""
    s = make_sched(num_blocks=4, block_size=4)
    d = Driver(s)
    d.add(make_req("a", range(1, 13), max_tokens=3))  # 3 blocks, 4 at the end
    d.add(make_req("b", range(21, 29), max_tokens=1))  # needs 2 blocks
    d.run()
    assert d.finish == {"a": "length", "b": "length"}
    assert s.kv.stats.requests == 2
    assert s.kv.stats.queries == 12 + 8


def test_siblings_wait_for_source_prefill_then_share_it():
    """n>1: siblings are queued right behind their source with prefill_after=source, as
    LLMEngine.add_request does. They must not be admitted until the source's prompt
    blocks are in the prefix cache, i.e. not in the step that computes the source's
    last prompt chunk (its blocks are indexed only in update_from_output)."""
    s = make_sched(block_size=4, max_num_batched_tokens=64)
    d = Driver(s)
    prompt = list(range(1, 14))  # 13 tokens: 3 full blocks
    src = d.add(make_req("0_x", prompt, max_tokens=3))
    d.add(make_req("1_x", prompt, max_tokens=3, prefill_after=src))
    d.add(make_req("2_x", prompt, max_tokens=3, prefill_after=src))
    out = d.step()
    assert set(out.num_scheduled_tokens) == {"0_x"}, "siblings admitted before the prefix is cached"
    out = d.step()
    hits = {r.req_id: r.num_computed_tokens for r in out.scheduled_new_reqs}
    assert hits == {"1_x": 12, "2_x": 12}
    d.run()


def test_siblings_wait_during_chunked_source_prefill():
    s = make_sched(block_size=4, max_num_batched_tokens=6)
    d = Driver(s)
    prompt = list(range(1, 14))
    src = d.add(make_req("0_x", prompt, max_tokens=2))
    d.add(make_req("1_x", prompt, max_tokens=2, prefill_after=src))
    other = d.add(make_req("o", [40, 41], max_tokens=1))  # behind the sibling, not blocked by it
    out = d.step()
    assert set(out.num_scheduled_tokens) == {"0_x"}  # 6 tokens: budget spent
    out = d.step()
    assert "1_x" not in out.num_scheduled_tokens  # source still mid-prefill
    d.run()
    assert other.status == RequestStatus.FINISHED_LENGTH
    assert d.tokens["1_x"] and d.finish["1_x"] == "length"


def test_skipped_siblings_keep_their_place_in_the_queue():
    s = make_sched(block_size=4, max_num_batched_tokens=64, max_num_seqs=2)
    d = Driver(s)
    prompt = list(range(1, 14))
    src = d.add(make_req("0_x", prompt, max_tokens=3))
    d.add(make_req("1_x", prompt, max_tokens=3, prefill_after=src))
    d.add(make_req("o", [40, 41], max_tokens=3))
    d.add(make_req("p", [50, 51], max_tokens=3))
    out = d.step()
    assert set(out.num_scheduled_tokens) == {"0_x", "o"}
    assert [r.request_id for r in s.waiting] == ["1_x", "p"]
    d.run()


def test_sibling_released_when_source_is_aborted():
    s = make_sched(block_size=4, max_num_batched_tokens=4)
    d = Driver(s)
    prompt = list(range(1, 14))
    src = d.add(make_req("0_x", prompt, max_tokens=2))
    d.add(make_req("1_x", prompt, max_tokens=2, prefill_after=src))
    d.step()
    d.abort(["0_x"])
    d.run()
    assert d.finish == {"0_x": "abort", "1_x": "length"}


# =====================================================================================
# abort
# =====================================================================================

def test_abort_waiting_and_running():
    s = make_sched(num_blocks=8, max_num_seqs=1, enable_caching=False)
    d = Driver(s)
    a = d.add(make_req("a", range(1, 10), max_tokens=20))
    b = d.add(make_req("b", range(1, 10), max_tokens=20))
    d.step()
    assert a.status == RequestStatus.RUNNING and b.status == RequestStatus.WAITING
    assert s.kv.num_free_blocks == 5
    d.abort(["b"])
    assert b.status == RequestStatus.FINISHED_ABORTED and "b" not in s.requests and not s.waiting
    d.abort(["a", "nope"])
    assert a.status == RequestStatus.FINISHED_ABORTED and not s.running
    assert s.kv.num_free_blocks == 8 and not s.requests
    d.abort(["a"])  # twice: no-op
    out = d.schedule()
    assert out.finished_req_ids == {"a", "b"} and out.is_empty


def test_abort_while_the_step_runs_is_ignored_by_update():
    s = make_sched()
    d = Driver(s)
    d.add(make_req("a", [1, 2, 3], max_tokens=5))
    d.add(make_req("b", [1, 2, 3], max_tokens=5))
    out = d.schedule()
    res = d.ex.execute(out)
    d.abort(["a"])
    core = s.update_from_output(out, res)
    assert [o.req_id for o in core] == ["b"]
    assert s.kv.num_free_blocks == s.kv.pool.num_blocks - 1
    check_ownership(s)


def test_abort_preempted_request():
    s = make_sched(num_blocks=4, block_size=4)
    d = Driver(s)
    for r in "abc":
        d.add(make_req(r, [1, 2, 3, 4], max_tokens=6))
    d.step()
    out = d.step()
    assert out.preempted_req_ids == {"c"}
    d.abort(["c"])
    assert "c" not in s.requests
    d.run()
    assert s.kv.num_free_blocks == 4


# =====================================================================================
# State machine: random add / step / abort
# =====================================================================================

BASES = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12], [20, 21, 22, 23, 24, 25, 26, 27]]


@st.composite
def prompts(draw, max_len):
    n = draw(st.integers(1, max_len - 1))
    base = draw(st.sampled_from(BASES + [[]]))
    k = draw(st.integers(0, min(n, len(base))))
    rest = draw(st.lists(st.integers(1, 40), min_size=n - k, max_size=n - k))
    return base[:k] + rest


class SchedulerMachine(RuleBasedStateMachine):
    @initialize(block_size=st.sampled_from([1, 2, 4]), max_model_len=st.integers(6, 24),
                extra_blocks=st.integers(0, 6), budget=st.integers(1, 24),
                max_num_seqs=st.integers(1, 6), caching=st.booleans())
    def setup(self, block_size, max_model_len, extra_blocks, budget, max_num_seqs, caching):
        # The pool holds at least one full-length request, else a lone request can never run.
        num_blocks = cdiv(max_model_len, block_size) + extra_blocks
        self.sched = make_sched(num_blocks=num_blocks, block_size=block_size,
                                max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                                max_model_len=max_model_len, enable_caching=caching)
        self.d = Driver(self.sched)
        self.n = 0

    def _new_id(self):
        self.n += 1
        return f"r{self.n}"

    @rule(data=st.data(), max_tokens=st.integers(1, 12), eos=st.booleans())
    def add(self, data, max_tokens, eos):
        prompt = data.draw(prompts(self.sched.config.max_model_len))
        self.d.add(make_req(self._new_id(), prompt, max_tokens, EOS if eos else None))

    @rule(data=st.data(), n=st.integers(1, 3), max_tokens=st.integers(1, 8))
    def add_siblings(self, data, n, max_tokens):
        prompt = data.draw(prompts(self.sched.config.max_model_len))
        src = self.d.add(make_req(self._new_id(), prompt, max_tokens))
        for _ in range(n):
            self.d.add(make_req(self._new_id(), prompt, max_tokens, prefill_after=src))

    @rule(k=st.integers(1, 6))
    def step(self, k):
        for _ in range(k):
            self.d.step()

    @rule(data=st.data())
    def step_with_abort_midway(self, data):
        """Abort some requests between schedule() and update_from_output()."""
        out = self.d.schedule()
        if self.sched.requests:
            rids = data.draw(st.sets(st.sampled_from(sorted(self.sched.requests)), max_size=2))
            self.d.abort(rids)
        self.d.finish_step(out)

    @precondition(lambda self: bool(self.sched.requests))
    @rule(data=st.data())
    def abort(self, data):
        rid = data.draw(st.sampled_from(sorted(self.sched.requests)))
        self.d.abort([rid])

    @invariant()
    def ownership(self):
        check_ownership(self.sched)

    def teardown(self):
        if not hasattr(self, "d"):  # setup itself failed
            return
        self.d.run(max_steps=5_000)
        s = self.sched
        assert not s.requests and not s.running and not s.waiting
        assert s.kv.num_free_blocks == s.kv.pool.num_blocks
        assert not s.kv.req_to_blocks
        assert set(self.d.finish) == set(self.d.tokens), "a request was lost"
        for rid, toks in self.d.tokens.items():
            if self.d.finish[rid] != "abort":
                assert toks, f"{rid} finished without output"
        event(f"preempted: {s.num_preemptions > 0}")
        event(f"prefix hits: {s.kv.stats.hits > 0}")
        event(f"aborted: {'abort' in self.d.finish.values()}")
        # the last finishes are reported on the next schedule
        out = self.d.schedule()
        assert out.is_empty


SchedulerMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=30,
                                              deadline=None)
TestSchedulerMachine = SchedulerMachine.TestCase


# =====================================================================================
# Property: output independent of preemption and chunking
# =====================================================================================

@st.composite
def workloads(draw):
    max_model_len = 24
    n = draw(st.integers(1, 8))
    return [(draw(prompts(max_model_len)), draw(st.integers(1, 16)), draw(st.booleans()))
            for _ in range(n)], max_model_len


def run_workload(reqs, max_model_len, **cfg):
    s = make_sched(max_model_len=max_model_len, **cfg)
    d = Driver(s)
    for i, (prompt, max_tokens, eos) in enumerate(reqs):
        d.add(make_req(f"w{i}", prompt, max_tokens, EOS if eos else None))
    d.run(max_steps=5_000)
    assert s.kv.num_free_blocks == s.kv.pool.num_blocks and not s.requests
    return d.tokens, d.finish, s.num_preemptions


@settings(max_examples=100, deadline=None)
@given(workloads(), st.sampled_from([1, 2, 4]), st.integers(0, 4), st.integers(1, 12),
       st.integers(1, 6), st.booleans())
def test_outputs_independent_of_preemption_and_chunking(wl, bs, extra, budget, seqs, caching):
    reqs, max_model_len = wl
    ref = run_workload(reqs, max_model_len, num_blocks=1000, block_size=bs,
                       max_num_batched_tokens=10_000, max_num_seqs=100)
    assert ref[2] == 0
    small = run_workload(reqs, max_model_len, num_blocks=cdiv(max_model_len, bs) + extra,
                         block_size=bs, max_num_batched_tokens=budget, max_num_seqs=seqs,
                         enable_caching=caching)
    event(f"preempted: {small[2] > 0}")
    assert small[0] == ref[0] and small[1] == ref[1]


def test_pool_smaller_than_one_full_request_is_rejected():
    with pytest.raises(ValueError, match="never fit"):
        make_sched(num_blocks=2, block_size=4, max_model_len=32)
