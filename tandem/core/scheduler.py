"""Continuous batching at iteration granularity.

Every step, each running request's `num_computed_tokens` catches up with its tokens within a
token budget and a sequence cap, so decode, prefill and chunked prefill share one batch. When
KV blocks run short the most recently admitted running request is preempted (its blocks are
dropped; it is recomputed later, mostly from the prefix cache) and resumes first.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from tandem.core.kv_cache_manager import KVCacheManager
from tandem.core.outputs import (
    CachedRequestData, EngineCoreOutput, ModelRunnerOutput, NewRequestData, SchedulerOutput,
)
from tandem.core.request import Request, RequestStatus


@dataclass(slots=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048


class Scheduler:
    def __init__(
        self, config: SchedulerConfig, kv_manager: KVCacheManager, clock: Callable[[], float]
    ) -> None:
        capacity = kv_manager.pool.num_blocks * kv_manager.block_size
        if capacity < config.max_model_len:
            raise ValueError(f"max_model_len {config.max_model_len} exceeds the KV pool ({capacity} tokens): "
                             "one request could never fit")
        self.config = config
        self.clock = clock  # injected: the engine passes real time, the simulator a virtual clock
        self.kv = kv_manager
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._finished_ids: set[str] = set()  # to report in the next SchedulerOutput
        self.num_preemptions = 0

    # ---- admission ----------------------------------------------------------------
    def add_request(self, req: Request) -> None:
        if req.request_id in self.requests:
            raise ValueError(f"duplicate request id {req.request_id!r}")
        if req.num_prompt_tokens == 0:
            raise ValueError("the prompt is empty")
        if req.num_prompt_tokens >= self.config.max_model_len:
            raise ValueError(
                f"the prompt has {req.num_prompt_tokens} tokens; this model serves at most "
                f"{self.config.max_model_len - 1} prompt tokens (max_model_len {self.config.max_model_len})"
            )
        req.max_model_len = self.config.max_model_len
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
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    # ---- one step -----------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(finished_req_ids=self._finished_ids)
        self._finished_ids = set()
        budget = self.config.max_num_batched_tokens

        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            num_new = min(req.num_tokens - req.num_computed_tokens, budget)
            new_block_ids = self.kv.allocate_slots(req, num_new)
            while new_block_ids is None:
                victim = self.running.pop()
                self._preempt(victim, out)
                if victim is req:
                    break
                new_block_ids = self.kv.allocate_slots(req, num_new)
            if new_block_ids is None:
                break  # req preempted itself; it was the last one
            out.scheduled_cached_reqs.append(
                CachedRequestData(req.request_id, new_block_ids, req.num_computed_tokens)
            )
            budget = self._commit(req, num_new, budget, out)
            i += 1

        skipped: list[Request] = []
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            if out.preempted_req_ids:
                break  # memory is short this step: do not admit new work
            req = self.waiting.popleft()
            if req.prefill_after is not None and not self._prefix_ready(req):
                skipped.append(req)
                continue
            computed_blocks, num_hit = self.kv.get_computed_blocks(req)
            num_new = min(req.num_tokens - num_hit, budget)
            new_block_ids = self.kv.allocate_slots(req, num_new, computed_blocks)
            if new_block_ids is None:
                self.waiting.appendleft(req)
                break
            if req.num_cached_tokens < 0:
                self.kv.record_prefix_query(req, num_hit)
                req.num_cached_tokens = num_hit
                req.first_scheduled_time = self.clock()
            req.num_computed_tokens = num_hit
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            out.scheduled_new_reqs.append(NewRequestData(
                req.request_id, list(req.prompt_token_ids), req.output_token_ids,
                req.sampling_params, new_block_ids, num_hit, req.eos_token_id,
            ))
            budget = self._commit(req, num_new, budget, out)
        self.waiting.extendleft(reversed(skipped))
        return out

    def _commit(self, req: Request, num_new: int, budget: int, out: SchedulerOutput) -> int:
        out.num_scheduled_tokens[req.request_id] = num_new
        out.total_num_scheduled_tokens += num_new
        req.num_computed_tokens += num_new
        return budget - num_new

    def _prefix_ready(self, req: Request) -> bool:
        src = req.prefill_after
        # A first output token means the prompt ran and its blocks are in the prefix cache.
        if src.status.finished or src.num_output_tokens > 0:
            req.prefill_after = None
            return True
        return False

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        self.kv.free(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)
        out.preempted_req_ids.add(req.request_id)

    # ---- after the step -----------------------------------------------------------
    def update_from_output(
        self, sched: SchedulerOutput, result: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        outputs, finished = [], False
        for req_id in sched.num_scheduled_tokens:
            req = self.requests.get(req_id)
            if req is None or req.status != RequestStatus.RUNNING:
                continue  # finished (aborted) while the step ran
            self.kv.cache_blocks(req)
            new_ids = []
            for token_id in result.sampled_token_ids.get(req_id, ()):
                req.append_token(token_id)
                new_ids.append(token_id)
                if req.check_stop():
                    break
            if not new_ids:
                continue
            lps = result.logprobs.get(req_id)
            outputs.append(EngineCoreOutput(
                req_id, new_ids, lps[:len(new_ids)] if lps else None,
                req.finish_reason, req.stop_reason,
            ))
            if req.status.finished:
                finished = True
                self._free(req)
        if finished:
            self.running = [r for r in self.running if not r.status.finished]
        return outputs

    def _free(self, req: Request) -> None:
        self.kv.free(req)
        self._finished_ids.add(req.request_id)
        del self.requests[req.request_id]
