"""Coalescing pure-decode steps. While an instance has nothing waiting and every running
request is decoding, each step schedules exactly one token per request: the real scheduler
would only allocate a block now and then and append a token. So until the next event that
could change the instance (an arrival, a transfer, a controller tick: the `horizon`), until
a request is one token from its end, or until blocks could run short, those steps are
applied here in one go, with each step's duration and each token's time exactly as stepping
would give them (tests/test_sim.py checks that). This is what lets an hour of a 32-instance
trace simulate in seconds."""

from __future__ import annotations

from typing import Protocol

from tandem.core.kv_cache_coordinator import cdiv
from tandem.core.kv_cache_manager import KVCacheManager
from tandem.core.scheduler import Scheduler
from tandem.sim.cost_model import BatchShape
from tandem.sim.executor import SIM_TOKEN, SimulatedExecutor
from tandem.sim.request import SimRequest

MIN_STEPS = 2


class DecodingInstance(Protocol):
    """What a run of decode steps reads and advances of a simulated instance (SimInstance)."""

    scheduler: Scheduler
    kv: KVCacheManager
    executor: SimulatedExecutor
    sim_reqs: dict[str, SimRequest]
    num_coalesced: int

    def account(self, seconds: float, usage: float) -> None: ...


def fast_forward(inst: DecodingInstance, now: float, horizon: float) -> float | None:
    """Apply k >= MIN_STEPS decode steps from `now`; returns when the last ends, or None
    when the instance is not in a steady decode run (then it steps normally)."""
    sched, kv = inst.scheduler, inst.kv
    running = sched.running
    if sched.waiting or not running:
        return None
    n, bs = len(running), kv.block_size
    # every request decodes each step only if L1's cap leaves room for all of them
    if n > sched.config.max_num_batched_tokens - sched.l2_token_reserve():
        return None
    k_max = 1 << 30
    for r in running:
        if r.num_computed_tokens != r.num_tokens - 1:
            return None
        k_max = min(k_max, r.max_tokens - r.num_output_tokens - 1)  # no request ends inside the run
    if k_max < MIN_STEPS:
        return None
    # New blocks needed per step, with a margin of one block per request for L2's hold.
    held = [kv.coordinator.num_held_blocks(r.request_id) for r in running]
    free0 = kv.num_free_blocks
    cost, context = inst.executor.cost, sum(r.num_tokens for r in running)
    times, usages, t = [], [], now
    for j in range(1, k_max + 1):
        new_blocks = sum(
            max(0, cdiv(r.num_computed_tokens + j, bs) - h) for r, h in zip(running, held)
        )
        if new_blocks + n > free0:
            break
        t_next = t + cost.step_time(
            BatchShape(num_decode_seqs=n, decode_context=context + n * (j - 1))
        )
        if t_next > horizon:
            break
        times.append(t_next)
        usages.append(1.0 - (free0 - new_blocks) / kv.pool.num_blocks)
        t = t_next
    k = len(times)
    if k < MIN_STEPS:
        return None
    kv.host_tier.release_pending_host_blocks()  # as the first schedule() of the run would
    for r in running:
        kv.allocate_slots(r, k)
        r.num_computed_tokens += k
        r.all_token_ids.extend([SIM_TOKEN] * k)
        kv.cache_blocks(r)
        inst.executor.num_tokens[r.request_id] += k
        sim = inst.sim_reqs[r.request_id]
        for tj in times:
            sim.on_token(tj)
    prev = now
    for tj, usage in zip(times, usages):
        inst.account(tj - prev, usage)
        prev = tj
    inst.num_coalesced += k
    return times[-1]
