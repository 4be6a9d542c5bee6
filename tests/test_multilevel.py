"""Multi-level queues (L1 interactive / L2 standard / L3 background), iteration-level
preemption, and swap to the host block tier.

Driven without a model, like tests/test_scheduler.py, by the fake executor of
tests/sched_harness.py, which mirrors everything the executor is told (block tables,
computed positions, and a host tier) and the *contents* of every device and host block, so
wrong swap pairs, a host block reused before it was read, a device block handed out twice, a
wrong num_computed_tokens on resume and bad prefix hits are all caught.

Sampled tokens are a deterministic function of (request id, the sequence so far), so the
outputs of a workload must not depend on the policy, the preemption mode or the pool size.
"""

from __future__ import annotations

import functools

import pytest
import sched_harness
from hypothesis import event, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import initialize, invariant, precondition, rule
from sched_harness import EOS, Clock, Driver, DriverMachine, PipelinedDriver, make_req, prompts

from tandem.config import SchedulerConfig
from tandem.core.kv_cache_coordinator import cdiv
from tandem.core.kv_cache_manager import KVCacheManager
from tandem.core.request import RequestStatus

# Multilevel queues and recompute-on-preemption unless a test says otherwise.
make_sched = functools.partial(
    sched_harness.make_sched, scheduling_policy="multilevel", preemption_mode="recompute"
)


def ids(reqs) -> list[str]:
    return [r.request_id for r in reqs]


# =====================================================================================
# Levels and config
# =====================================================================================


def test_level_is_priority_under_multilevel_and_2_under_fcfs():
    for policy, want in (("multilevel", [1, 2, 3]), ("fcfs", [2, 2, 2])):
        s = make_sched(scheduling_policy=policy)
        reqs = [make_req(f"p{p}", [1, 2], priority=p) for p in (1, 2, 3)]
        for r in reqs:
            s.add_request(r)
        assert [r.level for r in reqs] == want
        assert [s.waiting.count(level) for level in (1, 2, 3)] == [
            want.count(1),
            want.count(2),
            want.count(3),
        ]


def test_bad_config_and_priority_are_rejected():
    for kw in (
        dict(scheduling_policy="lifo"),
        dict(preemption_mode="disk"),
        dict(l2_min_share=1.0),
        dict(l2_min_share=-0.1),
        dict(l1_step_time=0.0),
        dict(l1_hold_s=-1.0),
        dict(scheduling_policy="multilevel", max_num_batched_tokens=1),
    ):
        with pytest.raises(ValueError):
            SchedulerConfig(**kw)
    from tandem.config import EngineConfig

    assert EngineConfig.from_kwargs(l1_step_time=0.1).scheduler_config.l1_step_time == 0.1
    s = make_sched()
    with pytest.raises(ValueError):
        s.add_request(make_req("x", [1], priority=0))
    assert not s.requests


# =====================================================================================
# L1 admission: seats
# =====================================================================================


def _seats_full_of_l2_l3(mode="recompute", **kw):
    """max_num_seqs=4: L2 a, b and L3 c, d decoding (c admitted before d)."""
    s = make_sched(max_num_seqs=4, preemption_mode=mode, l2_min_share=0.2, **kw)  # L2 floor: 1 seat
    d = Driver(s)
    for rid, p in (("a", 2), ("b", 2), ("c", 3), ("d", 3)):
        d.add(make_req(rid, [1, 2, 3], max_tokens=50, priority=p))
    d.step()
    d.step()
    assert ids(s.running) == ["a", "b", "c", "d"]
    return s, d


def test_l1_takes_a_seat_from_the_newest_l3_then_l3_then_l2_down_to_the_floor():
    s, d = _seats_full_of_l2_l3()
    expect = [("e", {"d"}), ("f", {"c"}), ("g", {"b"})]
    for rid, victims in expect:
        d.add(make_req(rid, [7, 8, 9], max_tokens=50, priority=1))
        out = d.step()
        assert rid in {r.req_id for r in out.scheduled_new_reqs}, f"L1 {rid} did not enter at once"
        assert out.preempted_req_ids == victims
    # a is the last L2 and ceil(0.2 * 4) = 1 seat is kept for L2: h must wait
    d.add(make_req("h", [7, 8, 9], max_tokens=50, priority=1))
    out = d.step()
    assert not out.preempted_req_ids and "h" not in out.num_scheduled_tokens
    assert sorted(ids(s.running)) == ["a", "e", "f", "g"]
    assert ids(s.waiting) == ["h", "b", "c", "d"]  # preempted L3s resume in admission order
    assert s.preemptions_by_mode == {"recompute": 3}


def test_l1_preempts_only_for_the_l1s_this_steps_budget_admits():
    """4 L1s with 8-token prompts arrive at once and the budget is 8: one L1 gets in this
    step, so only one L3 seat is taken (not four L3s preempted for L1s that wait anyway)."""
    s = make_sched(max_num_seqs=4, max_num_batched_tokens=8)
    d = Driver(s)
    for rid in "wxyz":
        d.add(make_req(rid, [1, 2], max_tokens=50, priority=3))
    d.step()
    for i in range(4):
        d.add(make_req(f"q{i}", range(10, 18), max_tokens=2, priority=1))
    out = d.step()
    assert out.preempted_req_ids == {"z"}
    assert [r.req_id for r in out.scheduled_new_reqs] == ["q0"]


def test_l1_never_preempts_l1():
    s = make_sched(max_num_seqs=2, num_blocks=64)
    d = Driver(s)
    for rid in "ab":
        d.add(make_req(rid, [1, 2, 3], max_tokens=20, priority=1))
    d.step()
    d.add(make_req("c", [4, 5], max_tokens=2, priority=1))
    for _ in range(5):
        out = d.step()
        assert not out.preempted_req_ids and "c" not in out.num_scheduled_tokens
    assert s.num_preemptions == 0


def test_seat_preemption_happens_under_fcfs_never():
    s, d = _seats_full_of_l2_l3(scheduling_policy="fcfs")
    d.add(make_req("e", [7, 8, 9], max_tokens=50, priority=1))
    out = d.step()
    assert not out.preempted_req_ids and "e" not in out.num_scheduled_tokens


def test_l2_waiting_takes_seats_from_l3_only():
    s, d = _seats_full_of_l2_l3()
    d.add(make_req("x", [7, 8], max_tokens=5, priority=2))
    out = d.step()
    assert out.preempted_req_ids == {"d"} and "x" in out.num_scheduled_tokens
    d.add(make_req("y", [7, 8], max_tokens=5, priority=2))
    out = d.step()
    assert out.preempted_req_ids == {"c"} and "y" in out.num_scheduled_tokens
    d.add(make_req("z", [7, 8], max_tokens=5, priority=2))
    out = d.step()  # only L2 left running: z waits, no L2 is preempted for it
    assert not out.preempted_req_ids and "z" not in out.num_scheduled_tokens


# =====================================================================================
# L1 admission: blocks
# =====================================================================================


def _blocks_full(l1_prompt_len):
    """6 blocks of 4, all held: L2 a, L2 b, L3 c (2 blocks each, at 7 tokens, so no decode
    needs a new block this step). An L1 arrives needing ceil(len/4) blocks."""
    s = make_sched(num_blocks=6, block_size=4, max_model_len=24, max_num_seqs=8, l2_min_share=0.0)
    d = Driver(s)
    for rid, p in (("a", 2), ("b", 2), ("c", 3)):
        d.add(make_req(rid, range(10 * ord(rid), 10 * ord(rid) + 7), max_tokens=10, priority=p))
    d.step()
    assert s.kv.num_free_blocks == 0
    d.add(make_req("e", range(1, l1_prompt_len + 1), max_tokens=3, priority=1))
    return s, d


def test_l1_short_of_blocks_preempts_l3_first():
    s, d = _blocks_full(8)  # 2 blocks: c is enough
    out = d.step()
    assert "e" in out.num_scheduled_tokens and out.preempted_req_ids == {"c"}


def test_l1_short_of_blocks_preempts_l3_then_l2():
    s, d = _blocks_full(12)  # 3 blocks: c, then the newest L2 (b)
    out = d.step()
    assert "e" in out.num_scheduled_tokens and out.preempted_req_ids == {"b", "c"}
    assert sorted(ids(s.running)) == ["a", "e"]


def test_l1_preempts_no_more_than_it_needs():
    """pool 4 x 4: L2 a and L3 b hold 2 blocks each at 8 tokens, so each needs a new block
    for its next decode. L1 e needs 1 block. Preempting b frees 2: e (1) and a's decode (1)
    both fit, so a must not be preempted. _make_room counts `growth` once before the loop and
    keeps counting b's growth after b is gone, so it also preempts a."""
    s = make_sched(num_blocks=4, block_size=4, max_model_len=16, l2_min_share=0.0)
    d = Driver(s)
    d.add(make_req("a", range(1, 9), max_tokens=6, priority=2))
    d.add(make_req("b", range(11, 19), max_tokens=6, priority=3))
    d.step()
    assert s.kv.num_free_blocks == 0
    d.add(make_req("e", [5, 6, 7], max_tokens=2, priority=1))
    out = d.step()
    assert "e" in out.num_scheduled_tokens
    assert out.preempted_req_ids == {"b"}, (
        f"preempted {sorted(out.preempted_req_ids)}, only b was needed"
    )
    assert "a" in out.num_scheduled_tokens


def test_l1_enters_next_step_while_l3_prefill_holds_the_token_budget():
    """An L3 prefill chunk takes the whole budget in the running loop (it runs before
    admission), so a newly arrived L1 gets cap 0 and waits until the L3 prompt is done."""
    s = make_sched(num_blocks=64, max_num_batched_tokens=8, max_model_len=128)
    d = Driver(s)
    d.add(make_req("bg", range(1, 61), max_tokens=2, priority=3))  # 60 tokens: 8 chunks
    d.step()
    d.add(make_req("q", [5, 6, 7], max_tokens=2, priority=1))
    out = d.step()
    assert "q" in out.num_scheduled_tokens, (
        f"L1 q not scheduled; the step went to {out.num_scheduled_tokens}"
    )


def test_l1_enters_next_step_while_l3_prefill_needs_the_blocks():
    """Same with memory: _make_room only counts one growth block per running request whose
    num_computed_tokens is block-aligned, but the L3's next prefill chunk takes 4 blocks in
    the running loop, leaving none for the L1 admitted after it."""
    s = make_sched(num_blocks=8, block_size=4, max_num_batched_tokens=16, max_model_len=32)
    d = Driver(s)
    d.add(make_req("bg", range(1, 31), max_tokens=2, priority=3))  # 30 tokens: 16 + 14
    d.step()
    assert s.kv.num_free_blocks == 4
    d.add(make_req("q", [5, 6], max_tokens=2, priority=1))  # 1 block, 2 tokens
    out = d.step()
    assert "q" in out.num_scheduled_tokens, (
        f"L1 q not scheduled; the step went to {out.num_scheduled_tokens}"
    )


@pytest.mark.parametrize("policy", ["fcfs", "multilevel"])
def test_top_up_admits_arrivals_into_the_step_planned_within_its_budget(policy):
    """Async scheduling plans a step while the one before runs; requests that arrive before
    it starts join it (top_up) as far as its budget and seats allow, preempting nothing."""
    s = make_sched(
        num_blocks=64, max_num_seqs=3, max_num_batched_tokens=16, scheduling_policy=policy
    )
    d = Driver(s)
    d.add(make_req("a", range(1, 11), max_tokens=3))  # 10 of 16 tokens
    out = d.schedule()
    d.add(make_req("q", [5, 6, 7], max_tokens=2, priority=1))
    d.add(make_req("r", [8, 9, 10, 11, 12], max_tokens=2, priority=1))
    d.top_up(out)
    assert out.num_scheduled_tokens == {"a": 10, "q": 3, "r": 3}  # r: a chunk of what is left
    d.finish_step(out)
    d.add(make_req("late", [1, 2], max_tokens=2, priority=1))
    out = d.schedule()
    d.add(make_req("later", [3, 4], max_tokens=2, priority=1))
    d.top_up(out)  # the three seats are taken: later waits, and nobody is preempted for it
    assert "later" not in out.num_scheduled_tokens and not out.preempted_req_ids
    d.finish_step(out)
    d.run()
    assert all(len(d.tokens[r]) == 2 for r in ("q", "r", "late", "later"))


def test_top_up_takes_only_the_step_just_planned():
    s = make_sched(scheduling_policy="multilevel")
    d = Driver(s)
    d.add(make_req("a", [1, 2, 3]))
    first = d.schedule()
    d.finish_step(first)
    d.schedule()
    with pytest.raises(ValueError, match="top_up takes the step"):
        s.top_up(first)


def test_swapped_l1_resumes_next_step_by_preempting_l2():
    """A swapped-out L1 needs cdiv(num_computed + 1, bs) device blocks to come back, but
    _make_room asks only for cdiv(num_new_tokens, bs) (1 block for a decode), so it does not
    preempt the running L2 and the L1 cannot be swapped in."""
    s = make_sched(
        num_blocks=10,
        block_size=4,
        max_model_len=40,
        max_num_batched_tokens=64,
        preemption_mode="swap",
        num_host_blocks=10,
        l2_min_share=0.0,
    )
    d = Driver(s)
    d.add(make_req("A", range(1, 13), max_tokens=2, priority=1))  # 3 blocks
    d.add(make_req("B", range(21, 45), max_tokens=8, priority=1))  # 6 blocks
    d.step()
    assert s.kv.num_free_blocks == 1
    d.add(make_req("X", range(51, 71), max_tokens=8, priority=2))  # 20 tokens: 5 blocks
    out = d.step()  # A takes the last block; B has none: B swaps itself out, X gets in
    assert out.preempted_req_ids == {"B"} and s.requests["B"].swapped
    assert "X" in out.num_scheduled_tokens and "A" not in s.requests  # A finished
    # Now: X holds 5 blocks, 5 free, B needs cdiv(25, 4) = 7: only preempting X lets B in.
    assert s.kv.num_free_blocks == 5
    out = d.step()
    assert "B" in out.num_scheduled_tokens, (
        "swapped L1 B not resumed though L2 X could be preempted"
    )
    assert out.preempted_req_ids == {"X"}


# =====================================================================================
# L2 share
# =====================================================================================


def test_l2_keeps_its_token_share_against_long_l1_prompts():
    s = make_sched(max_num_batched_tokens=20, l2_min_share=0.25, num_blocks=256, max_model_len=256)
    d = Driver(s)
    d.add(make_req("l2run", [1, 2, 3], max_tokens=30, priority=2))
    d.step()
    for i in range(3):
        d.add(make_req(f"l1_{i}", range(1, 101), max_tokens=2, priority=1))
    d.add(make_req("l2wait", range(200, 260), max_tokens=2, priority=2))
    for _ in range(6):
        out = d.step()
        l1 = sum(n for r, n in out.num_scheduled_tokens.items() if r.startswith("l1"))
        l2 = sum(n for r, n in out.num_scheduled_tokens.items() if r.startswith("l2"))
        assert l1 <= 20 - 5 and l1 > 0
        assert l2 >= 5 and out.num_scheduled_tokens.get("l2run") == 1
        assert out.total_num_scheduled_tokens == 20


def test_l1_takes_the_whole_budget_when_l2_has_no_work():
    s = make_sched(max_num_batched_tokens=20, l2_min_share=0.25, num_blocks=256, max_model_len=256)
    d = Driver(s)
    d.add(make_req("q", range(1, 101), max_tokens=2, priority=1))
    d.add(make_req("bg", [1, 2, 3], max_tokens=30, priority=3))
    for _ in range(4):
        out = d.step()
        assert out.num_scheduled_tokens == {"q": 20}  # nothing is reserved for L3


def test_lower_prefill_stays_throttled_for_l1_hold_s_after_l1_traffic():
    """After the last L1 request leaves, L2 prefills only its share for l1_hold_s more, so an
    L1 request arriving in a lull waits behind a short step; then it gets the whole budget."""
    clock = Clock()
    s = make_sched(
        max_num_batched_tokens=40,
        l2_min_share=0.25,
        num_blocks=256,
        max_model_len=512,
        l1_hold_s=2.0,
        clock=clock,
    )
    d = Driver(s)
    d.add(make_req("chat", [1, 2, 3], max_tokens=1, priority=1))
    d.add(make_req("doc", range(1, 301), max_tokens=2, priority=2))
    assert d.step().num_scheduled_tokens == {"chat": 3, "doc": 10}  # L1 present: L2 gets its share
    clock.t = 1.0
    assert d.step().num_scheduled_tokens == {"doc": 10}  # L1 gone, within the hold
    clock.t = 3.5
    assert d.step().num_scheduled_tokens == {"doc": 40}  # hold over: the whole budget


@pytest.mark.parametrize(
    "tokens,used,seconds,want",
    [
        (32, 32, 0.2, 16),  # twice the target: half
        (32, 32, 0.125, 25),  # over it: in proportion
        (
            32,
            20,
            0.4,
            10,
        ),  # over it, the throttle not reached: from what the step held, at most halved
        (16, 32, 0.2, 16),  # a step planned before the throttle shrank to 16: not shrunk twice
        (8, 32, 0.125, 8),  # ... nor raised back by it
        (10, 10, 1.0, 8),  # never below the floor (the share)
        (16, 16, 0.05, 32),  # under it and bounded by the throttle: more, at most 2x
        (48, 48, 0.01, 64),  # never above the ceiling (the budget)
        (32, 5, 0.05, 32),  # under it but not bounded: no evidence, unchanged
    ],
)
def test_adapt_throttle(tokens, used, seconds, want):
    from tandem.core.step_budget import adapt_throttle

    assert adapt_throttle(tokens, used, seconds, 0.1, 8, 64) == want


def test_one_token_prompt_chunks_count_against_the_throttle():
    """A prompt chunk cut to one token by the throttle is still prefill: it counts, so the
    lower levels cannot slip whole prompts in one token at a time past the throttle."""
    s = make_sched(
        num_blocks=256,
        max_num_batched_tokens=64,
        max_model_len=512,
        scheduling_policy="multilevel",
        l2_min_share=0.125,
        l1_step_time=0.1,
    )  # throttle 8 tokens
    d = Driver(s)
    d.add(make_req("chat", [5, 6, 7], max_tokens=50, priority=1))
    d.add(make_req("a", range(1, 8), max_tokens=2))  # 7 tokens
    for i in range(6):
        d.add(make_req(f"b{i}", range(10 + i, 30 + i), max_tokens=2))
    out = d.schedule()
    lower = sum(n for rid, n in out.num_scheduled_tokens.items() if rid != "chat")
    assert lower == out.num_throttled_prefill_tokens == 8


def test_l1_step_time_sizes_lower_prefill_from_measured_steps():
    """Under the L1 throttle an L2 prompt gets its share at first; steps under l1_step_time let
    it grow, steps over it shrink it back, never below the share. Without l1_step_time the
    measured times change nothing."""
    for step_time, want in ((0.1, [8, 16, 32, 16]), (None, [8, 8, 8, 8])):
        s = make_sched(
            num_blocks=256,
            max_num_batched_tokens=64,
            max_model_len=512,
            scheduling_policy="multilevel",
            l2_min_share=0.125,
            l1_step_time=step_time,
        )
        d = Driver(s)
        d.add(make_req("long", range(1, 401), max_tokens=2))
        d.add(make_req("chat", [5, 6, 7], max_tokens=50, priority=1))
        got = []
        for seconds in (0.05, 0.05, 0.2, 0.05):
            out = d.schedule()
            got.append(out.num_scheduled_tokens["long"])
            assert out.num_throttled_prefill_tokens == got[-1]
            s.observe_step(out, seconds)
            d.finish_step(out)
        assert got == want


def test_l2_is_not_starved_by_saturating_l1_traffic():
    s = make_sched(
        max_num_batched_tokens=16,
        l2_min_share=0.25,
        max_num_seqs=8,
        num_blocks=2048,
        max_model_len=128,
    )
    d = Driver(s)
    d.add(make_req("l2", range(1, 31), max_tokens=10, priority=2))
    l2 = s.requests["l2"]
    n = 0
    for step in range(200):
        for _ in range(2):
            d.add(make_req(f"q{n}", range(1, 21), max_tokens=3, priority=1))
            n += 1
        before = l2.num_computed_tokens
        out = d.step()
        if "l2" not in s.requests:
            break
        assert l2.status == RequestStatus.RUNNING
        assert l2.num_computed_tokens > before, f"L2 did not advance at step {step}"
        assert sum(v for k, v in out.num_scheduled_tokens.items() if k != "l2") <= 12
    assert d.finish["l2"] == "length" and step < 20


def _l2_under_l1_flood_with_tight_memory(mode, steps=100):
    """A 24-block pool that steady L1 traffic (2 arrivals a step, 20-token prompts) keeps
    full, and one L2 (30-token prompt, 10 new tokens). Returns the steps where the L2 was
    running when schedule() was called yet got no tokens, and whether it finished."""
    s = make_sched(
        max_num_batched_tokens=16,
        l2_min_share=0.25,
        max_num_seqs=8,
        num_blocks=24,
        block_size=4,
        max_model_len=64,
        preemption_mode=mode,
        num_host_blocks=64,
    )
    d = Driver(s)
    l2 = d.add(make_req("l2", range(1, 31), max_tokens=10, priority=2))
    n, stalls = 0, []
    for step in range(steps):
        for _ in range(2):
            if s.waiting.count(1) < 6:
                d.add(make_req(f"q{n}", range(100 + n, 120 + n), max_tokens=6, priority=1))
                n += 1
        running = l2.status == RequestStatus.RUNNING
        out = d.step()
        if running and not out.num_scheduled_tokens.get("l2"):
            stalls.append((step, sorted(out.preempted_req_ids)))
        if "l2" not in s.requests:
            break
    return stalls, d.finish.get("l2"), l2


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_l2_finishes_under_saturating_l1_traffic_when_memory_is_tight(mode):
    """Swap mode: an L1 prefill chunk that needs blocks picks the running L2 as victim
    (running-loop _victim ignores the L2 seat floor); swapped out, the L2 needs
    cdiv(num_computed + 1, bs) blocks at once, L1 admissions (done before L2's) take every
    block that frees up, and _make_room lets a waiting L2 preempt only L3. The L2 never
    comes back: starved for good although it has work and a reserved token share."""
    stalls, finish, l2 = _l2_under_l1_flood_with_tight_memory(mode)
    assert finish == "length", (
        f"L2 not done after 100 steps: {l2.num_computed_tokens} computed, swapped={l2.swapped}, "
        f"{l2.num_preemptions} preemptions"
    )


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_running_l2_advances_every_step_when_memory_is_tight(mode):
    """'Under saturating L1 traffic L2 still advances every step (if it has running
    requests)': with a tight pool the running L2 is preempted by L1 growth instead (and the
    blocks it frees admit new L1s in the same step)."""
    stalls, finish, l2 = _l2_under_l1_flood_with_tight_memory(mode)
    assert not stalls, f"running L2 got no tokens at (step, preempted): {stalls[:5]}"


def test_l2_seat_share_holds_for_waiting_l2():
    """The docstring promises L2 'a guaranteed share of the token budget and seats whenever
    it has work'. With max_num_seqs=2 and l2_min_share=0.5 (1 seat), L1 admission fills
    both seats while an L2 waits, and with steady L1 traffic the L2 never gets in."""
    s = make_sched(max_num_seqs=2, l2_min_share=0.5, max_num_batched_tokens=32, num_blocks=256)
    d = Driver(s)
    d.add(make_req("l2", [1, 2, 3], max_tokens=2, priority=2))
    n = 0
    for _ in range(30):
        while s.waiting.count(1) < 2:
            d.add(make_req(f"q{n}", [4, 5, 6], max_tokens=4, priority=1))
            n += 1
        d.step()
        if "l2" in d.finish:
            break
    assert "l2" in d.finish, "waiting L2 never got a seat under steady L1 traffic"


# =====================================================================================
# L3
# =====================================================================================


def test_l3_waits_while_an_l2_is_left_waiting():
    s = make_sched(num_blocks=6, block_size=4, max_model_len=24)
    d = Driver(s)
    d.add(make_req("a", range(1, 17), max_tokens=3, priority=2))  # 4 blocks
    d.add(make_req("b", range(21, 37), max_tokens=3, priority=2))  # 4 blocks: does not fit
    d.add(make_req("c", [5, 6, 7], max_tokens=2, priority=3))  # 1 block: would fit
    out = d.step()
    assert set(out.num_scheduled_tokens) == {"a"}
    while "b" not in s.running and s.num_unfinished:
        out = d.step()
        if "b" not in {r.request_id for r in s.running}:
            assert "c" not in out.num_scheduled_tokens, "L3 admitted while L2 b waits"
        else:
            break
    d.run()
    first = d.first_scheduled()
    assert first["c"] >= first["b"]


def test_l3_is_admitted_on_idle_capacity_and_is_preempted_first_for_growth():
    s = make_sched(num_blocks=5, block_size=2, max_model_len=10, l2_min_share=0.0)
    d = Driver(s)
    d.add(make_req("old3", [1, 2], max_tokens=8, priority=3))
    d.step()  # alone: L3 runs on idle capacity
    d.add(make_req("a", [3, 4], max_tokens=8, priority=2))
    d.add(make_req("b", [5, 6], max_tokens=8, priority=1))
    d.step()
    assert {r.request_id for r in s.running} == {"old3", "a", "b"}
    while not any(o.preempted_req_ids for o in d.outputs):
        d.step()
    first = next(o.preempted_req_ids for o in d.outputs if o.preempted_req_ids)
    assert first == {"old3"}  # oldest of all, but the lowest level


def test_fcfs_treats_priority_3_like_any_other():
    s = make_sched(scheduling_policy="fcfs", num_blocks=6, block_size=4, max_model_len=24)
    d = Driver(s)
    d.add(make_req("c", [5, 6, 7], max_tokens=2, priority=3))
    d.add(make_req("a", [1, 2, 3], max_tokens=2, priority=1))
    out = d.step()
    assert set(out.num_scheduled_tokens) == {"a", "c"}
    assert [r.req_id for r in out.scheduled_new_reqs] == ["c", "a"]


# =====================================================================================
# Resume order, max_preemptions
# =====================================================================================


def test_preempted_requests_resume_ahead_of_newer_requests_of_their_level():
    s, d = _seats_full_of_l2_l3()
    for rid in ("e", "f"):
        d.add(make_req(rid, [7, 8, 9], max_tokens=3, priority=1))
        d.step()
    assert ids(s.waiting) == ["c", "d"]
    d.add(make_req("late3", [1, 2], max_tokens=2, priority=3))
    assert ids(s.waiting) == ["c", "d", "late3"]
    d.run()
    first = d.first_scheduled()
    # the second admission of c and d (their resume) comes before late3's first
    resumes = {}
    for i, o in enumerate(d.outputs):
        for r in o.scheduled_new_reqs:
            resumes.setdefault(r.req_id, []).append(i)
    assert resumes["c"][1] <= resumes["d"][1] <= first["late3"]
    assert set(d.finish.values()) == {"length"}


def test_max_preemptions_shields_a_request_from_l1_admission():
    s = make_sched(max_num_seqs=2, max_preemptions=1, l2_min_share=0.0)
    d = Driver(s)
    d.add(make_req("x", [1, 2], max_tokens=40, priority=3))
    d.add(make_req("y", [3, 4], max_tokens=40, priority=3))
    d.step()
    d.add(make_req("a", [5, 6], max_tokens=1, priority=1))
    out = d.step()
    assert out.preempted_req_ids == {"y"} and s.requests["y"].num_preemptions == 1
    out = d.step()  # a finished: y comes back
    assert "y" in {r.req_id for r in out.scheduled_new_reqs}
    d.add(make_req("b", [5, 6], max_tokens=30, priority=1))
    out = d.step()  # y is newest but used up its preemptions: x goes instead
    assert out.preempted_req_ids == {"x"} and "b" in out.num_scheduled_tokens
    d.add(make_req("c", [5, 6], max_tokens=2, priority=1))
    out = d.step()  # only y is left to take: c waits
    assert not out.preempted_req_ids and "c" not in out.num_scheduled_tokens
    assert s.requests["y"].num_preemptions == 1


def test_max_preemptions_victim_for_growth_only_as_last_resort():
    def scenario(mark):
        s = make_sched(
            scheduling_policy="fcfs",
            num_blocks=5,
            block_size=4,
            max_model_len=20,
            max_preemptions=1,
        )
        d = Driver(s)
        for i, r in enumerate("abcd"):  # a, b at 4 tokens need a block next step; c, d at 3 not
            d.add(make_req(r, range(10 * i + 1, 10 * i + (5 if r in "ab" else 4)), max_tokens=6))
        d.step()  # each holds 1 block, 1 free
        for r in mark:  # as if preempted before
            s.requests[r].num_preemptions = 1
        return d.step().preempted_req_ids  # a takes the last block; b needs one

    assert scenario("") == {"d"}
    assert scenario("d") == {"c"}  # d is newest but at its bound: c goes
    assert scenario("cd") == {"d"}  # nobody else: the newest goes after all


# =====================================================================================
# Order within a level: spf with aging
# =====================================================================================


def test_spf_orders_by_prompt_length_with_aging():
    clock = Clock(1.0)
    s = make_sched(max_num_seqs=1, queue_order="spf", clock=clock)
    d = Driver(s)
    # keys at time t: len - 100 * (t - arrival): a 12-100t, b 4+10-100t, c 8-100t
    d.add(make_req("a", range(1, 13), max_tokens=1, arrival=0.0))
    d.add(make_req("b", range(1, 5), max_tokens=1, arrival=0.1))  # shortest but 0.1 s late
    d.add(make_req("c", range(1, 9), max_tokens=1, arrival=0.0))
    d.run()
    order = sorted(d.first_scheduled(), key=d.first_scheduled().get)
    assert order == ["c", "a", "b"]


def test_spf_without_aging_difference_is_shortest_first_and_preempted_go_first():
    clock = Clock(5.0)
    s = make_sched(max_num_seqs=2, queue_order="spf", clock=clock, l2_min_share=0.0)
    d = Driver(s)
    d.add(make_req("long3", range(1, 21), max_tokens=30, priority=3, arrival=0.0))
    d.add(make_req("mid3", range(1, 11), max_tokens=30, priority=3, arrival=0.0))
    d.step()
    d.add(make_req("q", [1, 2], max_tokens=2, priority=1, arrival=5.0))
    assert ids(s.running) == ["mid3", "long3"]  # same arrival: shorter prompt first
    out = d.step()
    assert out.preempted_req_ids == {"long3"}  # the newest L3
    d.add(make_req("short3", [1, 2, 3], max_tokens=2, priority=3, arrival=5.0))
    d.add(make_req("tiny3", [1], max_tokens=2, priority=3, arrival=5.0))
    # the preempted one first although its prompt is the longest
    assert [r.request_id for r in s.waiting.in_order(3)] == ["long3", "tiny3", "short3"]
    d.run()
    first = d.first_scheduled()
    resumes = {}
    for i, o in enumerate(d.outputs):
        for r in o.scheduled_new_reqs:
            resumes.setdefault(r.req_id, []).append(i)
    assert resumes["long3"][1] <= first["tiny3"] <= first["short3"]


# =====================================================================================
# Swap
# =====================================================================================


def _l3_victim(mode="swap", num_host_blocks=8, **kw):
    """max_num_seqs=1: L3 v (prompt 9 = 2 full blocks + 1) runs; then L1 q arrives."""
    s = make_sched(
        max_num_seqs=1,
        block_size=4,
        num_blocks=16,
        max_model_len=64,
        preemption_mode=mode,
        num_host_blocks=num_host_blocks,
        **kw,
    )
    d = Driver(s)
    v = d.add(make_req("v", range(1, 10), max_tokens=6, priority=3))
    d.step()
    d.step()
    assert v.num_computed_tokens == 10 and len(s.kv.block_ids(v)) == 3
    d.add(make_req("q", [40, 41], max_tokens=2, priority=1))
    return s, d, v


def test_swap_out_keeps_progress_and_swap_in_resumes_without_recompute():
    s, d, v = _l3_victim()
    dev = s.kv.block_ids(v)
    out = d.schedule()
    assert out.preempted_req_ids == {"v"} and "q" in out.num_scheduled_tokens
    assert v.swapped and v.status == RequestStatus.PREEMPTED and v.num_computed_tokens == 10
    (host,) = s.kv.host_tier.req_to_host_blocks["v"]
    assert out.blocks_to_swap_out == list(zip(dev, host)) and not out.blocks_to_swap_in
    assert s.preemptions_by_mode == {"swap": 1}
    assert s.kv.host_tier.num_free_host_blocks == 8 - 3
    d.finish_step(out)
    d.step()  # q finishes
    out = d.schedule()
    (new,) = out.scheduled_new_reqs
    assert new.req_id == "v" and new.num_computed_tokens == 10 and not v.swapped
    assert out.blocks_to_swap_in == list(zip(host, s.kv.block_ids(v)[:3]))
    assert out.num_scheduled_tokens == {"v": 1}  # a decode, not a prefill
    assert new.output_token_ids == d.tokens["v"]
    assert s.kv.host_tier.num_free_host_blocks == 5  # the 3 read now come back next step
    d.finish_step(out)
    d.run()
    assert d.ex.num_swap_outs == d.ex.num_swap_ins == 1
    assert s.kv.host_tier.num_free_host_blocks == 8 and s.kv.num_free_blocks == 16


def test_swap_falls_back_to_recompute_when_the_host_pool_is_short():
    s, d, v = _l3_victim(num_host_blocks=2)  # v holds 3 blocks
    out = d.step()
    assert out.preempted_req_ids == {"v"} and not out.blocks_to_swap_out
    assert not v.swapped and v.num_computed_tokens == 0
    assert "v" not in s.kv.coordinator.managers[0].req_to_blocks
    assert s.preemptions_by_mode == {"recompute": 1} and s.kv.host_tier.num_free_host_blocks == 2
    d.run()
    assert d.finish["v"] == "length"


def test_recompute_mode_never_swaps():
    s, d, v = _l3_victim(mode="recompute")
    out = d.step()
    assert out.preempted_req_ids == {"v"} and not out.blocks_to_swap_out and not v.swapped
    assert s.preemptions_by_mode == {"recompute": 1}
    d.run()


@pytest.mark.parametrize(
    "caching,swap_cost,recompute_cost,want",
    [
        (True, 2e-5, 1e-3, "swap"),  # 10 * 2e-5 < (10 - 8) * 1e-3
        (True, 1e-4, 1e-4, "recompute"),  # 10 * 1e-4 > 2 * 1e-4: the cached blocks make it cheap
        (False, 1e-4, 1e-4, "recompute"),  # tie: 10 * 1e-4 == 10 * 1e-4 -> not strictly cheaper
        (False, 0.9e-4, 1e-4, "swap"),  # no cached blocks: 10 * 0.9e-4 < 10 * 1e-4
        (True, 0.9e-4, 1e-4, "recompute"),  # same costs, but 8 of 10 tokens cached
    ],
)
def test_auto_mode_compares_swap_and_recompute_costs(caching, swap_cost, recompute_cost, want):
    s, d, v = _l3_victim(
        mode="auto",
        enable_caching=caching,
        swap_cost_per_token=swap_cost,
        recompute_cost_per_token=recompute_cost,
    )
    assert s.kv.num_cached_blocks(v) == (2 if caching else 0)
    out = d.step()
    assert out.preempted_req_ids == {"v"}
    assert s.preemptions_by_mode == {want: 1} and v.swapped == (want == "swap")
    assert bool(out.blocks_to_swap_out) == (want == "swap")
    d.run()


def test_abort_swapped_request_frees_its_host_blocks():
    s, d, v = _l3_victim()
    d.step()
    assert v.swapped and s.kv.host_tier.num_free_host_blocks == 5
    d.abort(["v"])
    assert s.kv.host_tier.num_free_host_blocks == 8 and "v" not in s.kv.host_tier.req_to_host_blocks
    d.run()
    assert d.finish["v"] == "abort" and s.kv.num_free_blocks == 16


def test_host_blocks_freed_by_swap_in_are_reusable_only_from_the_next_step():
    kv = KVCacheManager(8, block_size=4, num_host_blocks=3)
    host = kv.host_tier
    a = make_req("a", range(1, 10))
    kv.allocate_slots(a, 9)
    a.num_computed_tokens = 9
    pairs = host.swap_out(a)
    assert [[h for _, h in pairs]] == host.req_to_host_blocks["a"]
    assert host.num_free_host_blocks == 0
    swapped_in = host.swap_in(a, 1)
    assert swapped_in is not None
    assert host.num_free_host_blocks == 0  # read by this step's copies: not free yet
    b = make_req("b", range(1, 5))
    kv.allocate_slots(b, 4)
    b.num_computed_tokens = 4
    assert host.swap_out(b) is None  # in the same step: no host room
    host.release_pending_host_blocks()
    assert host.num_free_host_blocks == 3
    assert host.swap_out(b) is not None


def test_swap_in_waits_for_device_blocks_and_keeps_its_place():
    """fcfs + swap: a swapped request at the head of the queue blocks newer ones until its
    blocks fit, and comes back with its progress."""
    s = make_sched(
        scheduling_policy="fcfs",
        num_blocks=4,
        block_size=4,
        max_model_len=16,
        preemption_mode="swap",
        num_host_blocks=4,
    )
    d = Driver(s)
    for r in "abc":
        d.add(make_req(r, [1, 2, 3, 4], max_tokens=6))
    d.step()
    d.add(make_req("d", [5, 6], max_tokens=1))
    out = d.step()
    assert out.preempted_req_ids == {"c"} and s.requests["c"].swapped
    assert ids(s.waiting) == ["c", "d"]
    d.run()
    first = d.first_scheduled()
    resumes = {}
    for i, o in enumerate(d.outputs):
        for r in o.scheduled_new_reqs:
            resumes.setdefault(r.req_id, []).append(i)
    assert resumes["c"][1] <= first["d"]
    assert s.preemptions_by_mode["swap"] >= 1 and d.ex.num_swap_ins == d.ex.num_swap_outs
    assert set(d.finish.values()) == {"length"}


# =====================================================================================
# State machine
# =====================================================================================


class MultilevelMachine(DriverMachine):
    """Random adds (bursts, priorities, arrivals) / step / abort (swapped ones too); the step
    and abort rules come from DriverMachine."""

    driver = Driver

    @initialize(
        policy=st.sampled_from(["fcfs", "multilevel", "multilevel"]),
        mode=st.sampled_from(["swap", "recompute", "auto"]),
        order=st.sampled_from(["fcfs", "spf"]),
        block_size=st.sampled_from([1, 2, 4]),
        max_model_len=st.integers(6, 20),
        extra_blocks=st.integers(0, 4),
        host_blocks=st.integers(0, 12),
        budget=st.integers(2, 24),
        max_num_seqs=st.integers(1, 6),
        share=st.sampled_from([0.0, 0.2, 0.5]),
        max_preemptions=st.integers(0, 3),
        caching=st.booleans(),
    )
    def setup(
        self,
        policy,
        mode,
        order,
        block_size,
        max_model_len,
        extra_blocks,
        host_blocks,
        budget,
        max_num_seqs,
        share,
        max_preemptions,
        caching,
    ):
        num_blocks = cdiv(max_model_len, block_size) + extra_blocks
        self.clock = Clock()
        self.sched = make_sched(
            num_blocks=num_blocks,
            block_size=block_size,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=budget,
            max_model_len=max_model_len,
            scheduling_policy=policy,
            preemption_mode=mode,
            num_host_blocks=host_blocks,
            enable_caching=caching,
            clock=self.clock,
            queue_order=order,
            l2_min_share=share,
            max_preemptions=max_preemptions,
            swap_cost_per_token=0.5e-3,
            recompute_cost_per_token=1e-3,
        )
        self.d = self.driver(self.sched, self.clock, tick=0.01)
        self.n = 0
        self.swapped_aborts = 0

    @rule(
        data=st.data(), priority=st.integers(1, 3), max_tokens=st.integers(1, 12), eos=st.booleans()
    )
    def add_one(self, data, priority, max_tokens, eos):
        self.add(data, priority, max_tokens, eos)

    def add_arrival(self, data):
        self.add(
            data,
            data.draw(st.integers(1, 3)),
            data.draw(st.integers(1, 12)),
            data.draw(st.booleans()),
        )

    def add(self, data, priority, max_tokens, eos):
        prompt = data.draw(prompts(self.sched.max_model_len))
        self.n += 1
        self.d.add(
            make_req(
                f"r{self.n}",
                prompt,
                max_tokens,
                priority=priority,
                eos=EOS if eos else None,
                arrival=self.clock.t,
            )
        )

    @rule(data=st.data(), priorities=st.lists(st.integers(1, 3), min_size=2, max_size=5))
    def add_burst(self, data, priorities):
        for p in priorities:
            self.add(data, p, data.draw(st.integers(1, 12)), data.draw(st.booleans()))

    @precondition(lambda self: any(r.swapped for r in self.sched.waiting))
    @rule(data=st.data())
    def abort_swapped(self, data):
        rid = data.draw(
            st.sampled_from(sorted(r.request_id for r in self.sched.waiting if r.swapped))
        )
        self.swapped_aborts += 1
        self.d.abort([rid])

    @invariant()
    def state(self):
        self.d.check()

    def teardown(self):
        if not hasattr(self, "d"):
            return
        self.d.run(max_steps=5_000)
        s, kv = self.sched, self.sched.kv
        assert not s.requests and not s.running and not s.waiting
        assert kv.num_free_blocks == kv.pool.num_blocks
        assert not kv.coordinator.managers[0].req_to_blocks
        host = kv.host_tier
        host.release_pending_host_blocks()
        assert host.num_free_host_blocks == host.num_host_blocks and not host.req_to_host_blocks
        assert set(self.d.finish) == set(self.d.tokens), "a request was lost"
        for rid, toks in self.d.tokens.items():
            if self.d.finish[rid] != "abort":
                assert toks, f"{rid} finished without output"
        assert self.d.ex.num_swap_outs == s.preemptions_by_mode["swap"]
        event(f"swap: {s.preemptions_by_mode['swap'] > 0}")
        event(f"recompute: {s.preemptions_by_mode['recompute'] > 0}")
        event(f"swapped aborted: {self.swapped_aborts > 0}")
        event(f"re-admitted in the step it was preempted: {self.d.readmitted_same_step > 0}")
        event(f"preempted with a token in flight: {self.d.preempted_in_flight > 0}")
        assert self.d.schedule().is_empty


MultilevelMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=30, deadline=None
)
TestMultilevelMachine = MultilevelMachine.TestCase


class PipelinedMultilevelMachine(MultilevelMachine):
    """The same under async scheduling: step N+1 scheduled before step N's tokens are known."""

    driver = PipelinedDriver


PipelinedMultilevelMachine.TestCase.settings = MultilevelMachine.TestCase.settings
TestPipelinedMultilevelMachine = PipelinedMultilevelMachine.TestCase


# =====================================================================================
# Property: outputs do not depend on the scheduling
# =====================================================================================


@st.composite
def workloads(draw):
    n = draw(st.integers(1, 8))
    return [
        (
            draw(prompts(24)),
            draw(st.integers(1, 12)),
            draw(st.booleans()),
            draw(st.integers(1, 3)),
            draw(st.integers(0, 3)),
        )
        for _ in range(n)
    ]


def run_workload(reqs, policy, mode, small, bs, budget, seqs, pipelined=False):
    max_model_len = 24
    if small:
        kw = dict(
            num_blocks=cdiv(max_model_len, bs) + 2,
            num_host_blocks=cdiv(max_model_len, bs),
            max_num_batched_tokens=budget,
            max_num_seqs=seqs,
        )
    else:
        kw = dict(
            num_blocks=1000, num_host_blocks=1000, max_num_batched_tokens=10_000, max_num_seqs=100
        )
    s = make_sched(
        block_size=bs,
        max_model_len=max_model_len,
        scheduling_policy=policy,
        preemption_mode=mode,
        **kw,
    )
    d = (PipelinedDriver if pipelined else Driver)(s)
    pending = sorted(enumerate(reqs), key=lambda x: x[1][4])
    step = 0
    while pending or s.num_unfinished or getattr(d, "in_flight", None):
        while pending and pending[0][1][4] <= step:  # arrivals at their step
            i, (prompt, max_tokens, eos, priority, _) = pending.pop(0)
            d.add(
                make_req(f"w{i}", prompt, max_tokens, priority=priority, eos=EOS if eos else None)
            )
        d.step()
        step += 1
        assert step < 5_000
    assert s.kv.num_free_blocks == s.kv.pool.num_blocks and not s.requests
    return d.tokens, d.finish, dict(s.preemptions_by_mode)


@settings(max_examples=30, deadline=None)
@given(workloads(), st.sampled_from([1, 2, 4]), st.integers(2, 12), st.integers(1, 6))
def test_outputs_do_not_depend_on_policy_mode_or_pool(wl, bs, budget, seqs):
    ref = run_workload(wl, "fcfs", "recompute", False, bs, budget, seqs)
    assert not ref[2]
    for policy in ("fcfs", "multilevel"):
        for mode in ("swap", "recompute"):
            for small, pipelined in ((False, False), (True, False), (True, True)):
                got = run_workload(wl, policy, mode, small, bs, budget, seqs, pipelined)
                event(f"{policy}/{mode}/{'small' if small else 'large'} preempted: {bool(got[2])}")
                assert got[0] == ref[0] and got[1] == ref[1], (policy, mode, small, pipelined)
