"""Admission: waiting requests taken into a step's batch, level by level, with their prefix-cache
hits or their KV back from the host tier (the base of Scheduler: the state it reads is the
Scheduler's). Under multilevel, L1 makes room by preempting unscheduled lower-level requests and
leaves L2 its guaranteed seats and the blocks its running requests need to grow."""

from __future__ import annotations

from collections.abc import Callable

from tandem.core.kv_cache_coordinator import PerGroup
from tandem.core.outputs import NewRequestData
from tandem.core.preemption import Preemption
from tandem.core.request import Request, RequestStatus
from tandem.core.spec_planner import SpecPlanner
from tandem.core.step_budget import StepBudget


class Admission(Preemption):
    planner: SpecPlanner
    clock: Callable[[], float]

    def _admit_waiting(self, level: int, i: int, step: StepBudget) -> bool:
        """Admit waiting requests of `level` in order; under multilevel, make room by
        preempting unscheduled lower-level requests (running[i:]). False when a request had
        to stay waiting."""
        for req in self.waiting.in_order(level):
            cap = step.cap(level, req.num_tokens - req.num_computed_tokens)
            if cap <= 0:
                return False
            if req.prefill_after is not None and not self._prefix_ready(req):
                continue
            if req.num_output_placeholders:
                continue  # preempted with a token in flight: it resumes once that token is known
            while True:
                seats_held, blocks_held = self._held_for_l2(step) if level == 1 else (0, 0)
                if len(self.running) + len(step.admitted) + seats_held < self.config.max_num_seqs:
                    if self._admit(req, cap, step, blocks_held):
                        break
                victim = (
                    self._victim(i, step, keep_l2=self.l2_floor if level == 1 else 0)
                    if self.multilevel
                    else None
                )
                if victim is None:
                    return False
                self._preempt(victim, step.out)
        return True

    def _admit(self, req: Request, cap: int, step: StepBudget, blocks_held: int) -> bool:
        """Take a waiting request into this step's batch; False when its blocks do not fit."""
        out, kv = step.out, self.kv
        free = kv.num_free_blocks - blocks_held
        if req.swapped:
            num_new = min(req.num_tokens - req.num_computed_tokens, cap)
            lookahead = self._fit_lookahead(req, req.num_computed_tokens, num_new, free)
            if lookahead is None:
                return False
            swapped_in = kv.host_tier.swap_in(req, num_new + lookahead)
            if swapped_in is None:
                return False
            pairs, block_ids = swapped_in
            out.blocks_to_swap_in.extend(pairs)
            req.swapped = False
        else:
            computed_blocks, num_hit = kv.get_computed_blocks(req)
            num_new = min(req.num_tokens - num_hit, cap)
            lookahead = self._fit_lookahead(req, num_hit, num_new, free, computed_blocks)
            if lookahead is None:
                return False
            allocated = kv.allocate_slots(req, num_new + lookahead, computed_blocks)
            if allocated is None:
                return False
            block_ids = allocated
            if req.num_cached_tokens < 0:
                kv.record_prefix_query(req, num_hit)
                req.num_cached_tokens = num_hit
                req.first_scheduled_time = self.clock()
            req.num_computed_tokens = num_hit
        self.waiting.remove(req)
        req.status = RequestStatus.RUNNING
        step.admitted.append(req)
        self.planner.admit(req, lookahead, out)
        out.scheduled_new_reqs.append(
            NewRequestData(
                req.request_id,
                list(req.prompt_token_ids),
                req.output_token_ids,
                req.sampling_params,
                block_ids,
                req.num_computed_tokens,
                req.eos_token_id,
                req.precision,
            )
        )
        step.commit(req, num_new, req.num_tokens - req.num_computed_tokens)  # none in flight
        return True

    def _fit_lookahead(
        self, req: Request, num_computed: int, num_new: int, free: int, hit: PerGroup = ()
    ) -> int | None:
        """The lookahead slots the request takes besides its `num_new` tokens: the planner's
        when `free` blocks hold them too, else 0 (the drafts are what gives way). None when
        the tokens alone do not fit."""
        kv = self.kv
        lookahead = self.planner.lookahead(req, num_computed + num_new)
        if lookahead and kv.blocks_needed(req, num_new + lookahead, hit) <= free:
            return lookahead
        return 0 if kv.blocks_needed(req, num_new, hit) <= free else None

    def _prefix_ready(self, req: Request) -> bool:
        src = req.prefill_after
        assert src is not None  # called only for a request that waits on another's prefill
        # A first output token means the prompt ran and its blocks are in the prefix cache.
        if src.status.finished or src.num_output_tokens > 0:
            req.prefill_after = None
            return True
        return False
