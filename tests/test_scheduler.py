"""Scheduler: continuous batching, chunked prefill, preemption, prefix reuse, aborts.

Driven without a model by the fake executor of tests/sched_harness.py, which samples one
token for every scheduled request whose prefill has caught up (num_computed_tokens ==
num_tokens after schedule). Here the token is a deterministic function of the request id and
its length (fake_token_from_length), so runs can be compared.
"""

from __future__ import annotations

import functools

import pytest
import sched_harness
from hypothesis import event, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import initialize, invariant, rule
from sched_harness import (
    EOS,
    MAX_DRAFTS,
    DriverMachine,
    check_state,
    fake_propose,
    fake_token_from_length,
    make_req,
    make_sched,
    prompts,
    sample_from_length,
)

from tandem.core.kv_cache_coordinator import cdiv
from tandem.core.request import RequestStatus

# Tokens by (id, length); a preempted request must stay out for the rest of its step.
Driver = functools.partial(
    sched_harness.Driver, sample=sample_from_length, strict_preemption=True, max_steps=10_000
)
# Async scheduling: step N+1 is scheduled before step N's tokens are known.
PipelinedDriver = functools.partial(
    sched_harness.PipelinedDriver,
    sample=sample_from_length,
    strict_preemption=True,
    max_steps=10_000,
)


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
    assert set(out.num_scheduled_tokens) == {"a", "b"} and [r.request_id for r in s.waiting] == [
        "c"
    ]
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


def add_request_sampling_eos_first(d) -> str:
    """A 3-token request whose first sampled token is EOS (the fake executor's choice)."""
    rid = next(f"r{i}" for i in range(1000) if fake_token_from_length(f"r{i}", 3) == EOS)
    d.add(make_req(rid, [1, 2, 3], max_tokens=10, eos=EOS))
    return rid


def test_eos_stops_a_request():
    s = make_sched()
    d = Driver(s)
    rid = add_request_sampling_eos_first(d)
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
    check_state(s)


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


class SchedulerMachine(DriverMachine):
    """Random add / step / abort; the step and abort rules come from DriverMachine."""

    driver = Driver

    @initialize(
        block_size=st.sampled_from([1, 2, 4]),
        max_model_len=st.integers(6, 24),
        extra_blocks=st.integers(0, 6),
        budget=st.integers(1, 24),
        max_num_seqs=st.integers(1, 6),
        caching=st.booleans(),
    )
    def setup(self, block_size, max_model_len, extra_blocks, budget, max_num_seqs, caching):
        # The pool holds at least one full-length request, else a lone request can never run.
        num_blocks = cdiv(max_model_len, block_size) + extra_blocks
        self.sched = make_sched(
            num_blocks=num_blocks,
            block_size=block_size,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=budget,
            max_model_len=max_model_len,
            enable_caching=caching,
        )
        self.d = self.driver(self.sched)
        self.n = 0

    def _new_id(self):
        self.n += 1
        return f"r{self.n}"

    @rule(data=st.data(), max_tokens=st.integers(1, 12), eos=st.booleans())
    def add(self, data, max_tokens, eos):
        prompt = data.draw(prompts(self.sched.max_model_len))
        self.d.add(make_req(self._new_id(), prompt, max_tokens, eos=EOS if eos else None))

    def add_arrival(self, data):
        self.add(data, data.draw(st.integers(1, 12)), data.draw(st.booleans()))

    @rule(data=st.data(), n=st.integers(1, 3), max_tokens=st.integers(1, 8))
    def add_siblings(self, data, n, max_tokens):
        prompt = data.draw(prompts(self.sched.max_model_len))
        src = self.d.add(make_req(self._new_id(), prompt, max_tokens))
        for _ in range(n):
            self.d.add(make_req(self._new_id(), prompt, max_tokens, prefill_after=src))

    @invariant()
    def ownership(self):
        self.d.check()

    def teardown(self):
        if not hasattr(self, "d"):  # setup itself failed
            return
        self.d.run(max_steps=5_000)
        s = self.sched
        assert not s.requests and not s.running and not s.waiting
        assert s.kv.num_free_blocks == s.kv.pool.num_blocks
        assert not s.kv.coordinator.managers[0].req_to_blocks
        assert set(self.d.finish) == set(self.d.tokens), "a request was lost"
        for rid, toks in self.d.tokens.items():
            if self.d.finish[rid] != "abort":
                assert toks, f"{rid} finished without output"
        event(f"preempted: {s.num_preemptions > 0}")
        event(f"prefix hits: {s.kv.stats.hits > 0}")
        event(f"aborted: {'abort' in self.d.finish.values()}")
        event(f"preempted with a token in flight: {self.d.preempted_in_flight > 0}")
        # the last finishes are reported on the next schedule
        out = self.d.schedule()
        assert out.is_empty


SchedulerMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=30, deadline=None
)
TestSchedulerMachine = SchedulerMachine.TestCase


class PipelinedSchedulerMachine(SchedulerMachine):
    driver = PipelinedDriver


PipelinedSchedulerMachine.TestCase.settings = SchedulerMachine.TestCase.settings
TestPipelinedSchedulerMachine = PipelinedSchedulerMachine.TestCase


# =====================================================================================
# Property: output independent of preemption and chunking
# =====================================================================================


@st.composite
def workloads(draw):
    max_model_len = 24
    n = draw(st.integers(1, 8))
    return [
        (draw(prompts(max_model_len)), draw(st.integers(1, 16)), draw(st.booleans()))
        for _ in range(n)
    ], max_model_len


def run_workload(reqs, max_model_len, pipelined=False, propose=None, **cfg):
    s = make_sched(max_model_len=max_model_len, **cfg)
    d = (PipelinedDriver if pipelined else Driver)(s, propose=propose)
    for i, (prompt, max_tokens, eos) in enumerate(reqs):
        d.add(make_req(f"w{i}", prompt, max_tokens, eos=EOS if eos else None))
    d.run(max_steps=5_000)
    assert s.kv.num_free_blocks == s.kv.pool.num_blocks and not s.requests
    return d.tokens, d.finish, s.num_preemptions


@settings(max_examples=100, deadline=None)
@given(
    workloads(),
    st.sampled_from([1, 2, 4]),
    st.integers(0, 4),
    st.integers(1, 12),
    st.integers(1, 6),
    st.booleans(),
)
def test_outputs_independent_of_preemption_and_chunking(wl, bs, extra, budget, seqs, caching):
    reqs, max_model_len = wl
    ref = run_workload(
        reqs,
        max_model_len,
        num_blocks=1000,
        block_size=bs,
        max_num_batched_tokens=10_000,
        max_num_seqs=100,
    )
    assert ref[2] == 0
    small = run_workload(
        reqs,
        max_model_len,
        num_blocks=cdiv(max_model_len, bs) + extra,
        block_size=bs,
        max_num_batched_tokens=budget,
        max_num_seqs=seqs,
        enable_caching=caching,
    )
    event(f"preempted: {small[2] > 0}")
    assert small[0] == ref[0] and small[1] == ref[1]


@settings(max_examples=100, deadline=None)
@given(
    workloads(),
    st.sampled_from([1, 2, 4]),
    st.integers(0, 4),
    st.integers(1, 12),
    st.integers(1, 6),
    st.booleans(),
)
def test_pipelined_outputs_match_serial(wl, bs, extra, budget, seqs, caching):
    """Async scheduling (optimistic placeholders, a step in flight while the next is
    scheduled) gives the same tokens and finish reasons, under preemption and chunking."""
    reqs, max_model_len = wl
    ref = run_workload(
        reqs,
        max_model_len,
        num_blocks=1000,
        block_size=bs,
        max_num_batched_tokens=10_000,
        max_num_seqs=100,
    )
    small = run_workload(
        reqs,
        max_model_len,
        pipelined=True,
        num_blocks=cdiv(max_model_len, bs) + extra,
        block_size=bs,
        max_num_batched_tokens=budget,
        max_num_seqs=seqs,
        enable_caching=caching,
    )
    event(f"preempted: {small[2] > 0}")
    assert small[0] == ref[0] and small[1] == ref[1]


# =====================================================================================
# Async scheduling: placeholders for tokens in flight
# =====================================================================================


def test_pipelined_never_schedules_past_max_tokens():
    s = make_sched()
    d = PipelinedDriver(s)
    d.add(make_req("a", [1, 2, 3], max_tokens=2))
    a = s.requests["a"]
    assert d.step().num_scheduled_tokens == {"a": 3}  # prefill; its token is in flight
    assert a.num_output_placeholders == 1 and a.num_output_tokens == 0
    out = d.step()  # the decode of token 2 is scheduled before token 1 is known
    assert out.num_scheduled_tokens == {"a": 1} and len(d.tokens["a"]) == 1
    assert d.step().num_scheduled_tokens == {}  # token 2 is the last: nothing more to run
    assert d.finish["a"] == "length" and len(d.tokens["a"]) == 2
    assert s.kv.num_free_blocks == s.kv.pool.num_blocks and d.in_flight is None


def test_pipelined_drops_the_token_after_eos_and_frees_blocks():
    s = make_sched()
    d = PipelinedDriver(s)
    rid = add_request_sampling_eos_first(d)
    d.step()
    out = d.step()  # scheduled optimistically: the EOS is not known yet
    assert out.num_scheduled_tokens == {rid: 1}
    assert d.tokens[rid] == [EOS] and d.finish[rid] == "stop" and rid not in s.requests
    assert s.kv.num_free_blocks == s.kv.pool.num_blocks  # freed while its last step runs
    d.run()
    assert d.tokens[rid] == [EOS]  # the extra token never reaches the output


def test_pipelined_preempted_request_keeps_its_token_in_flight():
    """c is preempted while its first token is in flight: the token still counts, and c
    comes back only once it is known."""
    s = make_sched(num_blocks=4, block_size=4)
    d = PipelinedDriver(s)
    for r in "abc":
        d.add(make_req(r, [1, 2, 3, 4], max_tokens=6))
    d.step()  # each holds 1 block, 1 left; all three tokens in flight
    out = d.schedule()
    assert out.preempted_req_ids == {"c"} and s.requests["c"].num_output_placeholders == 1
    d.finish_step(out)  # the prefill's results arrive: c's token is appended while it waits
    c = s.requests["c"]
    assert c.status == RequestStatus.PREEMPTED and len(d.tokens["c"]) == 1
    assert c.num_output_placeholders == 0 and c.output_token_ids == d.tokens["c"]
    d.run()
    assert d.finish == {r: "length" for r in "abc"} and all(len(d.tokens[r]) == 6 for r in "abc")
    assert s.kv.num_free_blocks == 4 and not s.requests


def test_pool_smaller_than_one_full_request_is_rejected():
    with pytest.raises(ValueError, match="never fit"):
        make_sched(num_blocks=2, block_size=4, max_model_len=32)


# =====================================================================================
# Speculative steps: drafts with random acceptance (sched_harness.fake_propose)
# =====================================================================================


class SpecSchedulerMachine(SchedulerMachine):
    """The state machine with a draft proposal after every token: no leaked or doubly owned
    block, rollback to exactly the accepted tokens, no draft in the prefix cache."""

    driver = functools.partial(Driver, propose=fake_propose)

    def teardown(self):
        super().teardown()
        if hasattr(self, "d"):
            event(f"drafts accepted: {self.d.ex.num_accepted > 0}")
            event(f"drafts rejected: {self.d.ex.num_accepted < self.d.ex.num_drafts}")


SpecSchedulerMachine.TestCase.settings = settings(
    max_examples=80, stateful_step_count=30, deadline=None
)
TestSpecSchedulerMachine = SpecSchedulerMachine.TestCase


class PipelinedSpecSchedulerMachine(SpecSchedulerMachine):
    driver = functools.partial(PipelinedDriver, propose=fake_propose)


PipelinedSpecSchedulerMachine.TestCase.settings = SpecSchedulerMachine.TestCase.settings
TestPipelinedSpecSchedulerMachine = PipelinedSpecSchedulerMachine.TestCase


@settings(max_examples=80, deadline=None)
@given(
    workloads(),
    st.sampled_from([1, 2, 4]),
    st.integers(0, 4),
    st.integers(1, 12),
    st.integers(1, 6),
    st.booleans(),
    st.booleans(),
    st.sampled_from([0, 2, 4]),
    st.booleans(),
)
def test_speculative_outputs_match_plain(
    wl, bs, extra, budget, seqs, caching, pipelined, k, lookahead
):
    """Verify steps (drafts in the budget, rollback) give the tokens and finish reasons of
    plain decoding, under preemption, chunking, prefix hits and async scheduling. With
    lookahead (a draft model), draft KV written into the lookahead slots never shows in a
    request's verified positions nor in the prefix cache (the harness checks both)."""
    reqs, max_model_len = wl
    ref = run_workload(
        reqs,
        max_model_len,
        num_blocks=1000,
        block_size=bs,
        max_num_batched_tokens=10_000,
        max_num_seqs=100,
    )
    spec = run_workload(
        reqs,
        max_model_len,
        pipelined=pipelined,
        propose=fake_propose,
        num_blocks=cdiv(max_model_len, bs) + extra,
        block_size=bs,
        max_num_batched_tokens=budget,
        max_num_seqs=seqs,
        enable_caching=caching,
        num_speculative_tokens=k,  # k > 0: AdaptiveK picks each step's cap
        num_lookahead_tokens=(k or MAX_DRAFTS) if lookahead else 0,
    )
    event(f"preempted: {spec[2] > 0}")
    assert spec[0] == ref[0] and spec[1] == ref[1]


def test_verify_step_counts_drafts_and_rolls_back():
    """Drafts take budget and slots; a rejected tail is dropped from num_computed_tokens."""
    s = make_sched(block_size=4, max_num_batched_tokens=64)
    d = Driver(s, propose=lambda rid, toks, sample: [sample(rid, toks), 49, 49])
    req = d.add(make_req("a", [1, 2, 3], max_tokens=10))
    d.step()  # prefill, then a proposal of 3: one right, two wrong
    out = d.schedule()
    assert out.spec.draft_token_ids["a"][1:] == [49, 49] and out.num_scheduled_tokens["a"] == 4
    assert req.num_computed_tokens == 4 + 3
    d.finish_step(out)
    assert req.num_output_tokens == 3 and req.num_computed_tokens == req.num_tokens - 1 == 5
    assert (s.spec_stats.num_draft_tokens, s.spec_stats.num_accepted_tokens) == (3, 1)
    assert s.spec_stats.accepted_per_pos == [1, 0, 0]


def test_drafts_stop_short_of_max_tokens_and_budget():
    s = make_sched(block_size=4, max_num_batched_tokens=3)
    d = Driver(s, propose=lambda rid, toks, sample: [7, 7, 7, 7])
    d.add(make_req("a", [1, 2], max_tokens=4))
    d.step()
    out = d.schedule()
    assert len(out.spec.draft_token_ids["a"]) == 2  # budget 3: the position + 2 drafts
    d.finish_step(out)
    req = s.requests["a"]
    out = d.schedule()  # at most max_tokens - output - 1 drafts
    assert len(out.spec.draft_token_ids.get("a", [])) <= req.max_tokens - req.num_output_tokens - 1


def test_pipelined_verify_step_in_flight_behind_a_plain_step():
    """Regression (PipelinedSpecSchedulerMachine, shrunk): r3 verifies 2 drafts in step 6,
    step 7 is planned while step 6 runs and drafts nothing, so r3's computed positions run
    2 ahead of its tokens and placeholders. That is right (the drafts are in flight); the
    harness's bound, which allowed the slack only once a verify step had come back or was the
    last one planned, was wrong. The bound now counts the drafts of the steps not handed back."""
    s = make_sched(
        num_blocks=10,
        block_size=1,
        max_num_seqs=4,
        max_num_batched_tokens=4,
        max_model_len=6,
        enable_caching=False,
    )
    d = PipelinedDriver(s, propose=fake_propose)
    src = d.add(make_req("r1", [1], 4))
    for rid in ("r2", "r3"):
        d.add(make_req(rid, [1], 4, prefill_after=src))
    d.add(make_req("r4", [1], 4))
    ahead = []
    while s.num_unfinished or d.in_flight is not None:
        d.step()  # check_state after schedule and update, with the drafts not handed back
        ahead += [
            r.num_computed_tokens - r.num_tokens_with_placeholders
            for r in s.running
            if r.num_computed_tokens > r.num_tokens_with_placeholders
        ]
    assert (
        ahead and s.spec_stats.num_drafts > 0
    )  # the case arose: drafts in flight behind a plain step
    assert all(d.finish[r] == "length" and len(d.tokens[r]) == 4 for r in ("r1", "r2", "r3", "r4"))


def test_speculation_off_by_choice_is_the_plain_step():
    """Where a drafting step costs 3x a plain one, AdaptiveK leaves speculation off: the steps
    are planned as without speculation (no hand-back of the step in flight, no proposals asked
    for), except one probe per probe_every choices, and the tokens are those of plain decoding."""
    reqs = [(list(range(1 + i, 6 + i)), 100, False) for i in range(8)]
    ref = run_workload(reqs, 128, num_blocks=1000, max_num_batched_tokens=10_000, max_num_seqs=100)
    s = make_sched(num_blocks=300, max_model_len=128, num_speculative_tokens=4)
    d = PipelinedDriver(
        s, propose=fake_propose, step_seconds=lambda out: 0.03 if out.spec.drafting else 0.01
    )
    for i, (prompt, max_tokens, _) in enumerate(reqs):
        d.add(make_req(f"w{i}", prompt, max_tokens))
    d.run()
    drafting = [o for o in d.outputs if o.spec.drafting]
    proposing = [o for o in d.outputs if o.spec.propose]
    assert (d.tokens, d.finish) == (ref[0], ref[1]) and len(d.outputs) > 100
    # a probe per probe_every choices at batch 8, and one at the batch size of the last ones
    assert 1 <= len(drafting) <= 2 + len(d.outputs) // s.planner.policy.probe_every
    assert len(proposing) == len(drafting)  # asked for only in the step before each probe
