"""The step loop: schedule -> execute -> update (overlapped with async scheduling, see
step_pipeline.py), plus request admission and abort."""
from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Callable

from tandem.config import EngineConfig
from tandem.core.kv_cache_manager import KVCacheManager
from tandem.core.outputs import ModelRunnerOutput, SchedulerOutput
from tandem.core.queues import classify
from tandem.core.request import Request, RequestStatus
from tandem.core.sampling_params import SamplingParams
from tandem.core.scheduler import Scheduler
from tandem.engine.output_processor import OutputProcessor, RequestOutput
from tandem.engine.precision import PrecisionRouter
from tandem.engine.step_pipeline import ExecutedStep, StepPipeline
from tandem.engine.step_trace import StepTrace
from tandem.executor.base import Executor
from tandem.executor.grammar_compiler import GrammarCompiler
from tandem.executor.kv_transfer.handoff import KVHandoff
from tandem.executor.model_runner import ModelRunner
from tandem.models.llama import ModelConfig
from tandem.models.loader import load_config, load_tokenizer, resolve_model

PromptType = str | list[int]


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.model_dir = resolve_model(config.model)
        self.tokenizer = load_tokenizer(self.model_dir)
        self.pipeline = StepPipeline(lambda sched: self.executor.execute_model(sched), config.async_scheduling)
        mcfg = ModelConfig.from_hf(load_config(self.model_dir))
        self.vocab_size = mcfg.vocab_size
        eos = mcfg.eos_token_ids[:1]
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            eos = [self.tokenizer.eos_token_id]
        self.eos_token_id = eos[0] if eos else None
        # Structured outputs: compiles constraints off the step path; the executor masks with them.
        self.grammar_compiler = GrammarCompiler(self.tokenizer, self.vocab_size, self.eos_token_id)
        # Built on the thread that runs its steps: one OpenMP team in the process on CPU (a
        # second one, idle, makes OpenMP throttle its waits: slower steps when cores are few).
        self.executor: Executor = self.pipeline.call(ModelRunner, config, self.model_dir, self.grammar_compiler)
        self.precisions = PrecisionRouter(config, self.executor.variants.default, self.executor.variants.unavailable)
        capacity = self.executor.num_kv_blocks * self.executor.block_size
        self.max_model_len = min(config.max_model_len or mcfg.max_position_embeddings,
                                 mcfg.max_position_embeddings, capacity)
        self.kv_manager = KVCacheManager(
            self.executor.num_kv_blocks, config.block_size, config.enable_prefix_caching,
            config.max_prefix_tokens, config.min_match_length, self.executor.num_host_blocks,
        )
        # P/D export / import of KV blocks; a write waits for the steps in flight
        self.kv_handoff = KVHandoff(self.kv_manager, self.executor, lambda: self.pipeline.in_flight())
        swap_cost, recompute_cost = self.executor.preemption_costs()
        self.scheduler = Scheduler(
            config.scheduler_config(self.max_model_len, swap_cost, recompute_cost),
            self.kv_manager, time.monotonic,
        )
        self.output_processor = OutputProcessor(self.tokenizer)
        self._children: dict[str, list[str]] = {}
        self._ids = itertools.count()
        self._busy_since = 0.0  # perf_counter when the engine last got work after being empty
        self._last_execute_end: float | None = None
        # Called between two overlapped steps, before the later one is topped up: the server
        # passes in the requests that arrived while the earlier one ran.
        self.on_step_boundary: Callable[[], None] | None = None
        self.step_trace = StepTrace(config.step_trace) if config.step_trace else None
        self.reset_stats()

    def reset_stats(self) -> None:
        """Seconds per phase over all steps: schedule and update (engine thread), execute
        (the executor busy) and gap (the executor idle between two steps while the engine had
        work: what overlap removes). KV pool figures after each step: utilisation (tokens
        stored / capacity of the blocks held; 1 - internal fragmentation), summed to give a
        mean, and peak usage of the pool."""
        self.phase_times = {"schedule": 0.0, "execute": 0.0, "update": 0.0, "gap": 0.0}
        self.num_steps = self.num_gaps = 0
        self.kv_utilization_sum = 0.0
        self.kv_usage_peak = 0.0

    # ---- admission ----------------------------------------------------------------
    def tokenize(self, prompt: PromptType) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer: pass prompts as token ids")
            return self.tokenizer.encode(prompt)
        if not isinstance(prompt, (list, tuple)) or not all(isinstance(t, int) for t in prompt):
            raise ValueError("a prompt is a string or a list of token ids")
        bad = [t for t in prompt if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})")
        return list(prompt)

    def add_request(self, prompt: PromptType, params: SamplingParams | None = None,
                    request_id: str | None = None, arrival_time: float | None = None,
                    priority: int | None = None, precision: str | None = None) -> str:
        """Validate and queue a request; raises ValueError (nothing queued) on bad input.
        `priority` 1/2/3 (interactive/standard/background); None: classified by length.
        `precision`: the variant asked for; None: the priority's class, else the default."""
        params = params or SamplingParams()
        request_id = request_id if request_id is not None else str(next(self._ids))
        if request_id in self._children:
            raise ValueError(f"duplicate request id {request_id!r}")
        token_ids = self.tokenize(prompt)
        if params.structured_outputs is not None:
            # Compiled (or found in the cache) before anything is queued: a bad constraint is a
            # ValueError here. The server awaits the compile first, off the engine thread.
            self.grammar_compiler.get(params.structured_outputs)
        if not token_ids:
            raise ValueError("the prompt is empty")
        if len(token_ids) >= self.max_model_len:
            raise ValueError(f"the prompt has {len(token_ids)} tokens; this engine serves at most "
                             f"{self.max_model_len - 1} (max_model_len {self.max_model_len})")
        arrival_time = time.monotonic() if arrival_time is None else arrival_time
        if not self._children:
            self._busy_since = time.perf_counter()
        variant = self.precisions.choose(precision, priority)
        if priority is None:
            priority = classify(len(token_ids), params.max_tokens,
                                self.config.l1_max_prompt_tokens, self.config.l1_max_tokens)
        children = []
        first = None
        for i in range(params.n):
            seed = None if params.seed is None else params.seed + i
            child_params = dataclasses.replace(params, n=1, seed=seed) if params.n > 1 else params
            child_id = request_id if params.n == 1 else f"{i}_{request_id}"
            req = Request(child_id, token_ids, child_params, arrival_time, self.eos_token_id,
                          priority=priority, precision=variant, cache_salt=self.precisions.cache_salt(variant),
                          prefill_after=first if self.config.enable_prefix_caching else None)
            first = first or req
            children.append(req)
        self.output_processor.add(request_id, prompt if isinstance(prompt, str) else None, token_ids,
                                  [(r.request_id, r.sampling_params) for r in children], arrival_time, priority,
                                  variant)
        for req in children:
            self.scheduler.add_request(req)
        self._children[request_id] = [r.request_id for r in children]
        return request_id

    def abort_request(self, request_id: str) -> RequestOutput | None:
        child_ids = self._children.pop(request_id, [])
        self.scheduler.finish_requests(child_ids, RequestStatus.FINISHED_ABORTED)
        self.kv_handoff.release_admitted(self.scheduler.requests)
        outs = self.output_processor.abort(child_ids)
        return outs[0] if outs else None

    def has_unfinished_requests(self) -> bool:
        """Requests not finished, or a step still to hand back (async scheduling)."""
        return bool(self._children) or len(self.pipeline) > 0

    # ---- one step -----------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule a step and return the outputs of one executed step. Without async
        scheduling that is the step just scheduled. With it, the step just scheduled runs
        while the one before it is processed: the first call returns [] and each later one
        the outputs of the step before, and the step just scheduled waits for that one to
        end and is topped up with what arrived meanwhile (Scheduler.top_up)."""
        if self.pipeline.overlap and len(self.pipeline) and self.scheduler.plan_speculation():
            # Drafts follow a request's last token: a step that drafts is planned only once the
            # one in flight has returned (no overlap; steps where AdaptiveK says 0 overlap).
            return self._finish(self.pipeline.pop())
        t0 = time.perf_counter()
        sched = self.scheduler.schedule()
        self.phase_times["schedule"] += time.perf_counter() - t0
        done = None
        if not sched.is_empty or sched.finished_req_ids or sched.preempted_req_ids:
            if self.pipeline.overlap and len(self.pipeline):
                # Overlap: the step just planned waits for the one in flight, then takes in
                # what arrived meanwhile, so an arrival waits for one step, not two.
                try:
                    done = self.pipeline.pop()
                except BaseException:
                    self.scheduler.requeue_finished(sched.finished_req_ids)  # the planned step never runs
                    raise
                t0 = time.perf_counter()
                if self.on_step_boundary is not None:
                    self.on_step_boundary()
                self.scheduler.top_up(sched)
                self.phase_times["schedule"] += time.perf_counter() - t0
            self.kv_handoff.release_admitted(self.scheduler.requests)  # P/D: admitted requests hold their blocks now
            for new in sched.scheduled_new_reqs:
                req = self.scheduler.requests[new.req_id]
                self.output_processor.on_scheduled(new.req_id, req.first_scheduled_time,
                                                   req.num_cached_tokens, req.num_preemptions)
            self.pipeline.submit(sched)
        if done is None:
            if len(self.pipeline) == 0 or (self.pipeline.overlap and not sched.is_empty):
                return []  # idle, or the first step of a busy spell: it runs while the caller returns
            done = self.pipeline.pop()
        return self._finish(done)

    def _finish(self, done: ExecutedStep) -> list[RequestOutput]:
        t1 = time.perf_counter()
        outputs = self._update(done.sched, done.result)
        self.phase_times["update"] += time.perf_counter() - t1
        self._record(done)
        return outputs

    def _update(self, sched: SchedulerOutput, result: ModelRunnerOutput) -> list[RequestOutput]:
        core_outputs = self.scheduler.update_from_output(sched, result)
        outputs, stopped = self.output_processor.process(core_outputs)
        if stopped:
            self.scheduler.finish_requests(stopped, RequestStatus.FINISHED_STOPPED)
        for out in outputs:
            if out.finished:
                self._children.pop(out.request_id, None)
        return outputs

    def _record(self, done: ExecutedStep) -> None:
        self.scheduler.observe_step(done.sched, done.end - done.start)
        if self.step_trace is not None:
            self.step_trace.write(done, self.scheduler)
        self.num_steps += 1
        self.kv_utilization_sum += self.kv_manager.utilization
        self.kv_usage_peak = max(self.kv_usage_peak, self.kv_manager.usage)
        self.phase_times["execute"] += done.end - done.start
        # Idle time before the first step after the engine got work is not a gap.
        if self._last_execute_end is not None and self._last_execute_end >= self._busy_since:
            self.phase_times["gap"] += done.start - self._last_execute_end
            self.num_gaps += 1
        self._last_execute_end = done.end
