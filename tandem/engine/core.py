"""The engine core: scheduler + executor + KV pool + the step pipeline. In: requests already
tokenised and validated (EngineCoreRequest); out: per-step EngineCoreOutputs deltas and stats.
The step loop is schedule -> execute -> update, overlapped with async scheduling (see
step_pipeline.py). It runs in the engine-core process behind a server (core_proc.py) and in
the caller's process offline (llm_engine.py)."""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import msgspec

from tandem.config import EngineConfig
from tandem.core.kv_cache_manager import KVCacheManager
from tandem.core.kv_connector.pd import PDConnector
from tandem.core.outputs import EngineCoreOutput
from tandem.core.preemption import PreemptionCosts
from tandem.core.request import Request, RequestStatus
from tandem.core.sampling_params import LoRARequest, StructuredOutputsParams
from tandem.core.scheduler import Scheduler
from tandem.core.spec_planner import Speculation
from tandem.engine.core_messages import (
    AddLoRA,
    CompileGrammar,
    EngineCoreOutputs,
    EngineCoreRequest,
    GetSchedulerStats,
    RemoveLoRA,
    ScheduledEvent,
    SchedulerStats,
    UtilityMessage,
    child_ids,
)
from tandem.engine.core_stats import StepStats
from tandem.engine.lora_names import startup_loras
from tandem.engine.step_pipeline import ExecutedStep, StepPipeline
from tandem.engine.step_trace import StepTrace
from tandem.engine.tokenizer import get_tokenizer
from tandem.executor.base import Executor
from tandem.executor.grammar_compiler import GrammarCompiler
from tandem.executor.kv_transfer.handoff import KVHandoff
from tandem.models.config import ModelConfig
from tandem.models.loader.model_files import load_config, resolve_model

log = logging.getLogger(__name__)
ExecutorFactory = Callable[[EngineConfig, Any, GrammarCompiler], Executor]


def model_runner_factory(
    config: EngineConfig, model_dir, grammar_compiler: GrammarCompiler
) -> Executor:
    """The default executor: the model runner (imported here: torch only where it runs)."""
    from tandem.executor.model_runner import ModelRunner

    return ModelRunner(config, model_dir, grammar_compiler)


class EngineCore:
    def __init__(
        self, config: EngineConfig, executor_factory: ExecutorFactory = model_runner_factory
    ) -> None:
        self.config = config
        model, cache, sched_cfg = config.model_config, config.cache_config, config.scheduler_config
        self.model_dir = resolve_model(model.model)
        # the grammar compiler's vocabulary, and EOS
        self.tokenizer = get_tokenizer(
            model.model, model.tokenizer, model.chat_template, self.model_dir
        )
        mcfg = ModelConfig.from_hf(load_config(self.model_dir))
        context_len = mcfg.context_len(model.max_model_len)  # refused before the weights load
        self.vocab_size = mcfg.vocab_size
        eos = mcfg.eos_token_ids[:1]
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            eos = [self.tokenizer.eos_token_id]
        self.eos_token_id = eos[0] if eos else None
        self.pipeline = StepPipeline(
            lambda sched: self.executor.execute_model(sched), sched_cfg.async_scheduling
        )
        # Structured outputs: compiles constraints off the step path; the executor masks with them.
        self.grammar_compiler = GrammarCompiler(self.tokenizer, self.vocab_size, self.eos_token_id)
        # Built on the thread that runs its steps: one OpenMP team in the process on CPU (a
        # second one, idle, makes OpenMP throttle its waits: slower steps when cores are few).
        self.executor: Executor = self.pipeline.call(
            executor_factory, config, self.model_dir, self.grammar_compiler
        )
        for lora in startup_loras(config.lora_config):  # a refused one stops the start, in words
            self.add_lora(lora)
        self.kv_manager = KVCacheManager(
            self.executor.num_kv_blocks,
            cache.block_size,
            cache.enable_prefix_caching,
            cache.max_prefix_tokens,
            cache.min_match_length,
            self.executor.num_host_blocks,
            self.executor.kv_group_windows,
        )
        self.max_model_len = min(
            context_len,
            self.kv_manager.token_capacity(sched_cfg.max_num_batched_tokens),
        )
        self.scheduler = Scheduler(
            sched_cfg,
            self.kv_manager,
            time.monotonic,
            self.max_model_len,
            PreemptionCosts(*self.executor.preemption_costs()),
            Speculation.of(config.speculative_config),
        )
        # KV received from other instances: blocks reserved and pinned here (the scheduler
        # side), written by the handoff (the worker side), which waits for the steps in flight
        self.kv_connector = PDConnector(self.kv_manager.coordinator, self.scheduler.requests)
        self.kv_handoff = KVHandoff(
            self.kv_connector, self.executor, lambda: self.pipeline.in_flight()
        )
        self._children: dict[str, list[str]] = {}
        self.lora_requests: collections.Counter[str] = collections.Counter()  # by adapter name
        self._handlers: dict[type, Callable[..., Any]] = {
            CompileGrammar: self.compile_grammar,
            GetSchedulerStats: self.scheduler_stats,
            AddLoRA: self.add_lora,
            RemoveLoRA: self.remove_lora,
        }
        self._on_add_hooks: list[Callable[[str, dict, bool], None]] = []
        self._waiters = ThreadPoolExecutor(
            2, thread_name_prefix="tandem-utility"
        )  # utilities that wait
        self._scheduled: list[ScheduledEvent] = []
        # Called between two overlapped steps, before the later one is topped up: the core
        # process takes in the requests that arrived while the earlier one ran.
        self.on_step_boundary: Callable[[], None] | None = None
        trace = config.observability_config.step_trace
        self.step_trace = StepTrace(trace) if trace else None
        self.stats = StepStats(self)
        self.grammar_compiler.on_compile = self.stats.record_compile

    # ---- admission ----------------------------------------------------------------
    def register_utilities(
        self,
        handlers: Mapping[type, Callable[..., Any]],
        on_add: Callable[[str, dict, bool], None] | None = None,
    ) -> None:
        """Answer these utility message types (a handler gets the message's fields as keyword
        arguments); `on_add(request_id, kv_transfer, accepted)` runs right after each add that
        carries kv_transfer."""
        taken = handlers.keys() & self._handlers.keys()
        if taken:
            raise ValueError(
                f"engine-core utilities already handled: {sorted(t.__name__ for t in taken)}"
            )
        self._handlers.update(handlers)
        if on_add is not None:
            self._on_add_hooks.append(on_add)

    def utility(self, message: UtilityMessage) -> Any:
        """Run a utility message's handler; its result (a Future: the answer once it resolves).
        ValueError for a message type no handler here answers."""
        handler = self._handlers.get(type(message))
        if handler is None:
            raise ValueError(f"no engine-core utility answers {type(message).__name__} here")
        return handler(**msgspec.structs.asdict(message))

    def add_request(self, request: EngineCoreRequest) -> None:
        """Queue a request's sequences; ValueError (nothing queued) for a reused id or a
        constraint that does not compile. The on_add hooks run either way, before any step."""
        try:
            self._add(request)
        except Exception:
            self._on_add(request, accepted=False)
            raise
        self._on_add(request, accepted=True)

    def _add(self, request: EngineCoreRequest) -> None:
        rid = request.request_id
        ids = child_ids(rid, len(request.params))
        if rid in self._children or any(c in self.scheduler.requests for c in ids):
            raise ValueError(f"duplicate request id {rid!r}")
        for params in request.params[:1]:
            if params.structured_outputs is not None:
                # Compiled (or found in the cache) before anything is queued; the server
                # compiles it first through the compile_grammar utility, off the step loop.
                self.grammar_compiler.get(params.structured_outputs)
        if (
            not self._children
        ):  # no request left (a step for none may still be in flight): work starts now
            self.stats.busy_since = time.perf_counter()
        first = None
        for cid, params in zip(ids, request.params):
            if params.lora_request is not None:
                self.lora_requests[params.lora_request.lora_name] += 1
            req = Request(
                cid,
                request.prompt_token_ids,
                params,
                request.arrival_time,
                self.eos_token_id,
                priority=request.priority,
                precision=request.precision,
                cache_salt=request.cache_salt,
                prefill_after=first if self.config.cache_config.enable_prefix_caching else None,
            )
            first = first or req
            self.scheduler.add_request(req)
        self._children[rid] = ids

    def _on_add(self, request: EngineCoreRequest, accepted: bool) -> None:
        if request.kv_transfer is None:
            return
        for hook in self._on_add_hooks:
            try:
                hook(request.request_id, request.kv_transfer, accepted)
            except Exception:
                log.warning(
                    "on_add of %s failed; the request goes on without it",
                    request.request_id,
                    exc_info=True,
                )

    def abort_requests(
        self, request_ids: list[str], status: RequestStatus = RequestStatus.FINISHED_ABORTED
    ) -> None:
        """Finish requests (by parent id) or single sequences; unknown ids are ignored."""
        seqs = []
        for rid in request_ids:
            if rid in self._children:
                seqs += self._children.pop(rid)
            else:
                seqs.append(rid)
        self.scheduler.finish_requests(seqs, status)
        for rid in request_ids:
            self.kv_connector.request_finished(rid)
        self._forget_finished()

    def add_lora(self, lora: LoRARequest) -> None:
        """Load an adapter on the executor's thread, between steps; ValueError: refused."""
        self.pipeline.call(self.executor.add_lora, lora)

    def remove_lora(self, lora_int_id: int) -> None:
        self.pipeline.call(self.executor.remove_lora, lora_int_id)

    def lora_stats(self) -> dict[str, dict[str, int]]:
        """Per adapter name: requests (sequences) added, and the executor's figures."""
        stats = self.executor.lora_stats()
        for name, n in self.lora_requests.items():
            stats.setdefault(name, {})["requests"] = n
        return stats

    def abort_request(self, request_id: str) -> None:
        self.abort_requests([request_id])

    def unfinished_request_ids(self) -> list[str]:
        return list(self._children)

    def has_unfinished_requests(self) -> bool:
        """Requests not finished, or a step still to hand back (async scheduling)."""
        return bool(self._children) or len(self.pipeline) > 0

    def compile_grammar(self, structured_outputs: StructuredOutputsParams) -> Future:
        """Utility: compile a constraint (or find it cached) off the step loop. A Future of None,
        failing with the ValueError that names what is wrong (or that it took too long)."""
        return self._waiters.submit(self._wait_compiled, structured_outputs)

    def _wait_compiled(self, structured_outputs: StructuredOutputsParams) -> None:
        self.grammar_compiler.get(structured_outputs)

    def scheduler_stats(self) -> SchedulerStats:
        return self.stats.snapshot()

    # ---- one step -----------------------------------------------------------------
    def step(self) -> EngineCoreOutputs | None:
        """Schedule a step and return the outputs of one executed step (None: none came
        back yet). Without async scheduling that is the step just scheduled. With it, the step
        just scheduled runs while the one before it is processed: the first call returns None
        and each later one the outputs of the step before, and the step just scheduled waits
        for that one to end and is topped up with what arrived meanwhile (Scheduler.top_up)."""
        if self.pipeline.overlap and len(self.pipeline) and self.scheduler.planner.will_draft():
            # Drafts follow a request's last token: a step that drafts is planned only once the
            # one in flight has returned (no overlap; steps that do not draft overlap).
            return self._finish(self.pipeline.pop())
        t0 = time.perf_counter()
        sched = self.scheduler.schedule()
        self.stats.phase_times["schedule"] += time.perf_counter() - t0
        done = None
        if not sched.is_empty or sched.finished_req_ids or sched.preempted_req_ids:
            if self.pipeline.overlap and len(self.pipeline):
                # Overlap: the step just planned waits for the one in flight, then takes in
                # what arrived meanwhile, so an arrival waits for one step, not two.
                try:
                    done = self.pipeline.pop()
                except BaseException:
                    self.scheduler.requeue_finished(
                        sched.finished_req_ids
                    )  # the planned step never runs
                    raise
                t0 = time.perf_counter()
                if self.on_step_boundary is not None:
                    self.on_step_boundary()
                self.scheduler.top_up(sched)
                self.stats.phase_times["schedule"] += time.perf_counter() - t0
            self.kv_connector.build_connector_meta(sched)
            for new in sched.scheduled_new_reqs:
                req = self.scheduler.requests[new.req_id]
                self._scheduled.append(
                    ScheduledEvent(
                        new.req_id,
                        req.first_scheduled_time,
                        req.num_cached_tokens,
                        req.num_preemptions,
                    )
                )
            self.pipeline.submit(sched)
        if done is None:
            if len(self.pipeline) == 0 or (self.pipeline.overlap and not sched.is_empty):
                # idle, or the first step of a busy spell: it runs while the caller returns
                return None
            done = self.pipeline.pop()
        return self._finish(done)

    def _finish(self, done: ExecutedStep) -> EngineCoreOutputs:
        t1 = time.perf_counter()
        outputs: list[EngineCoreOutput] = self.scheduler.update_from_output(done.sched, done.result)
        self._forget_finished(outputs)
        now = time.monotonic()
        self.stats.phase_times["update"] += time.perf_counter() - t1
        # The step's cost as throughput sees it: the executor's time and its idle wait before
        # it (a drafting step waits for the engine to hand back the step in flight first).
        seconds = done.end - done.start + self.stats.record(done)
        self.scheduler.observe_step(done.sched, seconds)
        self.scheduler.planner.observe_step(done.sched, seconds, done.result.propose_time)
        if self.step_trace is not None:
            self.step_trace.write(done, self.scheduler)
        scheduled, self._scheduled = self._scheduled, []
        return EngineCoreOutputs(outputs, now, scheduled, done.end - done.start)

    def _forget_finished(self, outputs: list[EngineCoreOutput] = ()) -> None:
        """Drop parents none of whose sequences the scheduler still holds."""
        if not any(o.finish_reason is not None for o in outputs) and outputs:
            return
        live = self.scheduler.requests
        for rid in [r for r, ids in self._children.items() if not any(c in live for c in ids)]:
            del self._children[rid]
