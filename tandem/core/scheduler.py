"""Continuous batching at iteration granularity, with multi-level queues and preemption.

Every step, each running request's `num_computed_tokens` catches up with its tokens within a
token budget and a sequence cap, so decode, prefill and chunked prefill share one batch.

Policy `fcfs` (the baseline): one queue; when KV blocks run short the most recently admitted
running request is preempted. Policy `multilevel`: L1 (interactive) enters the very next
iteration, preempting running L3 and then L2 requests when seats or blocks are short; L2 keeps
a guaranteed share of the token budget and seats whenever it has work; L3 runs only on what
L1 and L2 leave idle and is preempted first. A victim is swapped to the host tier or dropped
for recompute, whichever costs less; it resumes ahead of newer requests of its level, and a
request preempted `max_preemptions` times is no longer chosen while others can be.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable
from operator import attrgetter

from tandem.config.scheduler import SchedulerConfig, SchedulingPolicy
from tandem.core.admission import Admission
from tandem.core.kv_cache_manager import KVCacheManager
from tandem.core.outputs import (
    CachedRequestData,
    EngineCoreOutput,
    ModelRunnerOutput,
    SchedulerOutput,
)
from tandem.core.preemption import PreemptionCosts
from tandem.core.queues import LEVELS, WaitingQueues
from tandem.core.request import Request, RequestStatus, check_prompt_length
from tandem.core.spec_decode import SpecDecodeStats
from tandem.core.spec_planner import SpecPlanner, Speculation
from tandem.core.step_budget import StepBudget, adapt_throttle

# Frozen, so one shared instance serves as every default
DEFAULT_COSTS = PreemptionCosts()
NO_SPECULATION = Speculation()


class Scheduler(Admission):
    """Its parts, one job each: admission of waiting requests (admission.py), preemption
    (preemption.py); here, the step's plan, the running requests' catch-up and the results."""

    def __init__(
        self,
        config: SchedulerConfig,
        kv_manager: KVCacheManager,
        clock: Callable[[], float],
        max_model_len: int,
        costs: PreemptionCosts = DEFAULT_COSTS,
        speculation: Speculation = NO_SPECULATION,
    ) -> None:
        capacity = kv_manager.token_capacity(config.max_num_batched_tokens)
        if capacity < max_model_len:
            raise ValueError(
                f"max_model_len {max_model_len} exceeds the KV pool ({capacity} "
                "tokens): one request could never fit"
            )
        self.config, self.max_model_len, self.costs = config, max_model_len, costs
        self.clock = clock  # injected: the engine passes real time, the simulator a virtual clock
        self.kv = kv_manager
        self._windows = any(w is not None for w in kv_manager.group_windows)
        self.multilevel = config.scheduling_policy == SchedulingPolicy.MULTILEVEL
        self.l2_floor = (
            math.ceil(config.l2_min_share * config.max_num_seqs) if self.multilevel else 0
        )
        self.waiting = WaitingQueues(config.queue_order, clock)
        self._l1_seen = -math.inf  # when L1 work was last present (see SchedulerConfig.l1_hold_s)
        self.running: list[Request] = []  # by level, then admission order
        self.requests: dict[str, Request] = {}
        self._finished_ids: set[str] = set()  # to report in the next SchedulerOutput
        self._step: StepBudget | None = None  # the last step planned, for top_up
        # Lower-level prompt tokens per step while L1 traffic is present (see observe_step)
        self._floor_tokens = max(
            int(config.l2_min_share * config.max_num_batched_tokens), kv_manager.block_size
        )
        self.lower_prefill_tokens = self._floor_tokens
        self.num_preemptions = 0
        self.preemptions_by_mode: Counter[str] = Counter()
        self.planner = SpecPlanner(speculation)  # speculative decoding's decisions

    # ---- admission ----------------------------------------------------------------
    def add_request(self, req: Request) -> None:
        if req.request_id in self.requests:
            raise ValueError(f"duplicate request id {req.request_id!r}")
        check_prompt_length(req.num_prompt_tokens, self.max_model_len)
        if req.priority not in LEVELS:
            raise ValueError(f"priority must be 1, 2 or 3, got {req.priority!r}")
        req.max_model_len = self.max_model_len
        req.level = req.priority if self.multilevel else 2
        self.requests[req.request_id] = req
        self.waiting.append(req)

    def finish_requests(self, req_ids: list[str], status: RequestStatus) -> None:
        """Abort or stop requests from outside a step (client gone, stop string matched)."""
        for req_id in req_ids:
            req = self.requests.get(req_id)
            if req is None or req.status.finished:
                continue
            if req.status == RequestStatus.RUNNING:
                self.running.remove(req)
            else:
                self.waiting.remove(req)
            req.status = status
            self._free(req)

    @property
    def spec_stats(self) -> SpecDecodeStats:
        """The acceptance counters since start (read-only: for stats and benches)."""
        return self.planner.stats

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    # ---- one step -----------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        """Level by level (just one level under fcfs): running requests of the level catch
        up, then its waiting requests are admitted. Requests admitted this step join the
        running list at the end, so every victim picked during the step is unscheduled."""
        out = SchedulerOutput(finished_req_ids=self._finished_ids)
        self._finished_ids = set()
        self.kv.host_tier.release_pending_host_blocks()
        cfg, budget = self.config, self.config.max_num_batched_tokens
        self.planner.plan(out, self.running)
        if self.multilevel:
            self.running.sort(key=attrgetter("level"))  # stable: admission order within a level
        reserve = self.l2_token_reserve()
        # While interactive (L1) traffic is present, lower levels prefill only
        # lower_prefill_tokens per step (their share, or what keeps a step near l1_step_time):
        # a step stays short, so an arriving L1 request waits at most one short step, and
        # running L1 requests keep a steady ITL. Their decodes always fit.
        if self.multilevel and (
            self.waiting.count(1) > 0 or any(r.level == 1 for r in self.running)
        ):
            self._l1_seen = self.clock()
        l1_active = self.multilevel and self.clock() - self._l1_seen <= cfg.l1_hold_s
        step = StepBudget(
            out,
            budget,
            budget - reserve,
            self.lower_prefill_tokens if l1_active else budget,
            throttled=l1_active,
        )
        i, blocked = 0, False
        for level in LEVELS if self.multilevel else (2,):
            i = self._schedule_running(level, i, step)
            if not self.multilevel and out.preempted_req_ids:
                break  # memory is short this step: admit nothing new
            if level == 3 and (blocked or self.waiting.count(1) or self.waiting.count(2)):
                break  # L3 only on capacity that L1 and L2 leave idle
            blocked |= not self._admit_waiting(level, i, step)
            if level == 1 and blocked:
                step.lower_prefill_cap, step.throttled = (
                    budget,
                    False,
                )  # L1 cannot get in now: let the rest finish sooner
        self._end_step(step)
        return out

    def l2_token_reserve(self) -> int:
        """Tokens of a step's budget that L1 may not take: L2's guaranteed share, while L2 has
        work (multilevel only). At least one token: a running L2 that the seat floor shields
        from preemption must also advance, or an L1 short of blocks preempts itself, step after
        step, forever."""
        cfg, budget = self.config, self.config.max_num_batched_tokens
        l2_work = self.multilevel and (
            self.waiting.count(2) > 0 or any(r.level == 2 for r in self.running)
        )
        return (
            min(max(1, int(cfg.l2_min_share * budget)), budget - 1)
            if l2_work and cfg.l2_min_share > 0
            else 0
        )

    def top_up(self, out: SchedulerOutput) -> None:
        """Admit, into the step just planned (`out`, not yet run), requests that arrived since
        it was planned, within what is left of its budget, seats and blocks. Under async
        scheduling the engine plans a step while the one before runs and tops it up when that
        one ends, so an arrival waits for the step in flight, not also for the step planned
        behind it. Nothing is preempted here: running requests not in the step keep theirs."""
        step = self._step
        if step is None or step.out is not out:
            raise ValueError("top_up takes the step schedule() returned last")
        if not self.multilevel and out.preempted_req_ids:
            return  # fcfs: memory is short this step, admit nothing new
        for level in LEVELS if self.multilevel else (2,):
            if level == 3 and (self.waiting.count(1) or self.waiting.count(2)):
                break
            if not self._admit_waiting(level, len(self.running), step):
                break
        self._end_step(step)

    def _end_step(self, step: StepBudget) -> None:
        self.running.extend(step.admitted)
        step.admitted.clear()
        self._step = step
        if step.throttled:
            step.out.num_throttled_prefill_tokens = step.lower_prefill_used

    def requeue_finished(self, req_ids: set[str]) -> None:
        """Report these finished requests again with the next step: the step that carried
        them was planned but never ran, so the executor still holds their state."""
        self._finished_ids |= req_ids

    def observe_step(self, out: SchedulerOutput, seconds: float) -> None:
        """A step that ran took `seconds`: adapt the L1 throttle to `l1_step_time` (the engine
        and the simulator call this after each step)."""
        if (
            self.config.l1_step_time is not None
            and out.num_throttled_prefill_tokens
            and seconds > 0
        ):
            self.lower_prefill_tokens = adapt_throttle(
                self.lower_prefill_tokens,
                out.num_throttled_prefill_tokens,
                seconds,
                self.config.l1_step_time,
                self._floor_tokens,
                self.config.max_num_batched_tokens,
            )

    def _schedule_running(self, level: int, i: int, step: StepBudget) -> int:
        """Catch up the running requests of `level` (from index i); returns the next index.
        When blocks run short, the lowest-level, newest unscheduled request is preempted."""
        floor = self.l2_floor if level == 1 else 0
        running, planner, out = self.running, self.planner, step.out  # preemption edits in place
        while i < len(running) and running[i].level == level:
            req = running[i]
            pending = req.num_tokens_with_placeholders - req.num_computed_tokens
            cap = step.cap(level, pending)
            if (
                cap <= 0
                or pending <= 0
                or (
                    req.num_output_placeholders
                    and req.num_output_tokens + req.num_output_placeholders >= req.max_tokens
                )
            ):
                i += 1  # no budget left, its verify step is in flight, or its last token is
                continue
            if pending == 1 and not (req.spec.draft_token_ids or planner.max_lookahead):
                k = lookahead = 0  # a plain decode (the hot path): nothing to verify or look past
                num_new = 1
            else:
                k = planner.num_drafts(req, pending, cap)
                num_new = min(pending, cap) + k
                lookahead = planner.lookahead(req, req.num_computed_tokens + num_new)
            new_block_ids = self._allocate(req, num_new + lookahead, step)
            if new_block_ids is None and (
                k or lookahead
            ):  # blocks are short: drop the drafts first
                k, lookahead, num_new = 0, 0, min(pending, cap)
                new_block_ids = self._allocate(req, num_new, step)
            if new_block_ids is None and num_new > 1:  # a shorter prefill chunk may fit
                held = self._held_for_l2(step)[1] if level == 1 else 0
                room = self.kv.token_room(req, self.kv.num_free_blocks - held)
                if room > 0:
                    num_new = min(num_new, room)
                    new_block_ids = self._allocate(req, num_new, step)
            while new_block_ids is None:
                victim = self._victim(i + 1, step, keep_l2=floor, last_resort=True) or req
                self._preempt(victim, out)
                if victim is req:
                    break
                new_block_ids = self._allocate(req, num_new, step)
            if new_block_ids is None:
                continue  # req preempted itself; index i now holds the next request
            out.scheduled_cached_reqs.append(
                CachedRequestData(req.request_id, new_block_ids, req.num_computed_tokens)
            )
            if k or lookahead or req.spec.draft_token_ids:
                planner.schedule(req, k, lookahead, out)
            step.commit(req, num_new, pending)
            i += 1
        return i

    def _allocate(self, req: Request, num_new: int, step: StepBudget) -> list[int] | None:
        """allocate_slots, except that L1 may not take the blocks held for L2's share."""
        if req.level == 1:
            held, kv = self._held_for_l2(step)[1], self.kv
            # With nothing held allocate_slots makes this check, but after freeing the blocks
            # behind sliding windows: with windows it must come first, to change nothing.
            checked = held or self._windows
            if checked and kv.blocks_needed(req, num_new) > kv.num_free_blocks - held:
                return None
        return self.kv.allocate_slots(req, num_new)

    # ---- after the step -----------------------------------------------------------
    def update_from_output(
        self, sched: SchedulerOutput, result: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        """Under async scheduling the next step is already scheduled (and may hold requests
        this one finishes: their extra token is dropped) and a request may have been
        preempted since this step was scheduled: its token still counts."""
        outputs, finished = [], False
        requests, sampled_ids = self.requests, result.sampled_token_ids  # a request's hot path
        # without drafts verified or proposed this step, after_step has nothing to do
        spec_step = bool(sched.spec.draft_token_ids or result.spec_token_ids)
        cache_blocks = self.kv.cache_blocks
        for req_id in sched.num_scheduled_tokens:
            req = requests.get(req_id)
            if req is None:
                continue  # finished (aborted, stopped) while the step ran
            status = req.status
            sampled = sampled_ids.get(req_id, ())
            if sampled:
                req.num_output_placeholders -= 1  # one per step that samples, however many tokens
            new_ids, stopped = [], False
            tokens = req.all_token_ids
            for token_id in sampled:
                tokens.append(token_id)
                new_ids.append(token_id)
                if req.check_stop():
                    stopped = True
                    break
            num_drafts = num_accepted = 0
            if spec_step or req.spec.draft_token_ids:
                num_drafts, num_accepted = self.planner.after_step(req, sched, result, len(sampled))
            # After the append: a block may end in the token just sampled, whose KV the step
            # in flight computes (it runs before any step that could hit the block).
            cache_blocks(req)
            if not new_ids:
                continue
            lps = result.logprobs.get(req_id)
            outputs.append(
                EngineCoreOutput(
                    req_id,
                    new_ids,
                    lps[: len(new_ids)] if lps else None,
                    req.finish_reason if stopped else None,
                    req.stop_reason,
                    num_drafts,
                    num_accepted,
                    result.prompt_logprobs.get(req_id),
                )
            )
            if stopped:
                finished = True
                if status != RequestStatus.RUNNING:
                    self.waiting.remove(req)
                self._free(req)
        if finished:
            self.running = [r for r in self.running if not r.status.finished]
        return outputs

    def _free(self, req: Request) -> None:
        self.kv.free(req)
        self._finished_ids.add(req.request_id)
        del self.requests[req.request_id]
