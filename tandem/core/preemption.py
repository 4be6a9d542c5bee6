"""Who is preempted, how, and what L1 must leave to L2: pure helpers, and `Preemption`, the
scheduler's preemption step (the base of Scheduler: the state it reads is the Scheduler's)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from tandem.config.scheduler import PreemptionMode, SchedulerConfig
from tandem.core.kv_cache_manager import KVCacheManager
from tandem.core.outputs import SchedulerOutput
from tandem.core.queues import WaitingQueues
from tandem.core.request import Request, RequestStatus
from tandem.core.step_budget import StepBudget


@dataclass(frozen=True, slots=True)
class PreemptionCosts:
    """What auto mode weighs, per token: seconds to move its KV out and back, and to prefill
    it again (the executor measures both at start)."""

    swap_cost_per_token: float = 2e-5
    recompute_cost_per_token: float = 1e-3


def pick_victim(
    candidates: list[Request],
    running: list[Request],
    admitted: list[Request],
    keep_l2: int,
    max_preemptions: int,
    last_resort: bool,
) -> Request | None:
    """The lowest-level, most recently admitted of `candidates` (running requests not yet
    scheduled this step, in level-then-admission order) that was not preempted
    `max_preemptions` times yet (one that was, only as a `last_resort`, when memory must be
    found); never an L2 that would take L2 below `keep_l2` running."""
    l2_running = (
        sum(1 for r in running if r.level == 2) + sum(1 for r in admitted if r.level == 2)
        if keep_l2
        else 0
    )
    fallback = None
    for req in reversed(candidates):
        if req.level == 2 and keep_l2 and l2_running <= keep_l2:
            continue
        if req.num_preemptions < max_preemptions:
            return req
        fallback = fallback or req
    return fallback if last_resort else None


def preemption_mode(
    req: Request, kv: KVCacheManager, mode: PreemptionMode, costs: PreemptionCosts
) -> PreemptionMode:
    """swap or recompute, whichever costs less for this victim (auto); blocks still in the
    prefix cache make recompute cheap."""
    if mode != PreemptionMode.AUTO:
        return mode
    to_recompute = req.num_computed_tokens - kv.num_cached_blocks(req) * kv.block_size
    swap_cost = req.num_computed_tokens * costs.swap_cost_per_token
    if swap_cost < to_recompute * costs.recompute_cost_per_token:
        return PreemptionMode.SWAP
    return PreemptionMode.RECOMPUTE


def l2_hold(
    l2_running: list[Request],
    l2_waiting_head: Request | None,
    kv: KVCacheManager,
    l2_floor: int,
    tokens: int,
) -> tuple[int, int]:
    """Seats and blocks L1 must leave this step: the blocks the running L2 requests of the
    guaranteed seats need for their `tokens` share, and, while L2 runs below its guaranteed
    seats, a seat and blocks for the first waiting L2."""
    blocks = 0
    guaranteed = l2_running[:l2_floor]
    for r in guaranteed:
        chunk = max(1, min(r.num_tokens_with_placeholders - r.num_computed_tokens, tokens))
        tokens = max(tokens - chunk, 0)
        blocks += max(kv.blocks_needed(r, chunk), 0)
    if len(guaranteed) >= l2_floor or l2_waiting_head is None:
        return 0, blocks
    head = l2_waiting_head
    chunk = max(1, min(head.num_tokens_with_placeholders - head.num_computed_tokens, tokens))
    return 1, blocks + max(kv.blocks_needed(head, chunk), 0)


class Preemption:
    config: SchedulerConfig
    costs: PreemptionCosts
    kv: KVCacheManager
    waiting: WaitingQueues
    running: list[Request]  # by level, then admission order
    multilevel: bool
    l2_floor: int  # L2's guaranteed seats (multilevel)
    num_preemptions: int
    preemptions_by_mode: Counter[str]

    def _victim(
        self, first: int, step: StepBudget, keep_l2: int = 0, last_resort: bool = False
    ) -> Request | None:
        return pick_victim(
            self.running[first:],
            self.running,
            step.admitted,
            keep_l2,
            self.config.max_preemptions,
            last_resort,
        )

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        """Take a running request out of the step: its KV swapped to the host tier or dropped
        for recompute, whichever is cheaper (blocks still in the prefix cache make recompute
        cheap); it waits at the front of its level."""
        self.running.remove(req)
        mode = preemption_mode(req, self.kv, self.config.preemption_mode, self.costs)
        pairs = self.kv.host_tier.swap_out(req) if mode == PreemptionMode.SWAP else None
        if pairs is not None:
            out.blocks_to_swap_out.extend(pairs)
            req.swapped = True
        else:
            mode = PreemptionMode.RECOMPUTE
            self.kv.free(req)
            req.num_computed_tokens = 0
        req.status = RequestStatus.PREEMPTED
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.preemptions_by_mode[mode.value] += 1
        self.waiting.push_front(req)
        out.preempted_req_ids.add(req.request_id)

    def _held_for_l2(self, step: StepBudget) -> tuple[int, int]:
        """Seats and blocks L1 must leave L2 this step (see l2_hold). Computed once a step: L1
        work only shrinks what L2 needs, so the first figure is safe."""
        if step.l2_hold is None:
            step.l2_hold = (0, 0)
            if self.multilevel and step.l1_cap < step.budget:
                l2 = [r for r in self.running if r.level == 2]
                head = self.waiting.in_order(2)[0] if self.waiting.count(2) else None
                step.l2_hold = l2_hold(l2, head, self.kv, self.l2_floor, step.budget - step.l1_cap)
        return step.l2_hold
