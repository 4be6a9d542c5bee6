"""The engine core's figures, computed in the engine process and sent with each step: phase
times and KV pool figures over all steps (benches), the scheduler's state now (/metrics, the
dashboard) and the instance's load report for the router (GET /tandem/state).

The load report's queue counts and KV figures are taken every step (O(1)); the per-request
prefill backlog, the preempted requests waiting and the cached-prefix summary at most every
`full_interval` seconds, and always when the engine goes idle, so an idle instance never
reports stale load. Its keys are `tandem.cluster.policy.routing.InstanceState`'s fields plus a few
extras (block size, per level); the API side adds model, role and elastic."""

from __future__ import annotations

import collections
import dataclasses
import time
from typing import Protocol

from tandem.core.instance_state import Backlog, instance_load, request_backlog
from tandem.core.kv_cache_manager import KVCacheManager
from tandem.core.queues import LEVELS
from tandem.core.scheduler import Scheduler
from tandem.engine.core_messages import SchedulerStats
from tandem.engine.step_pipeline import ExecutedStep

MAX_PREFIXES = 4096  # newest cached block hashes reported to the router


class StatsSource(Protocol):
    """What the figures are read from: the engine core."""

    scheduler: Scheduler
    kv_manager: KVCacheManager
    max_model_len: int

    def has_unfinished_requests(self) -> bool: ...

    def lora_stats(self) -> dict[str, dict[str, int]]: ...


class StepStats:
    def __init__(self, core: StatsSource, full_interval: float = 0.2) -> None:
        self.core = core
        self.full_interval = full_interval
        self._last_full = float("-inf")
        self._backlog = Backlog(0, 0)
        self.busy_since = 0.0  # perf_counter when the engine last got work after being empty
        self._last_execute_end: float | None = None
        self._compiles: list[tuple[str, float]] = []  # appended by the grammar compiler's workers
        self.reset()

    def reset(self) -> None:
        """Seconds per phase over all steps: schedule and update (engine thread), execute
        (the executor busy) and gap (the executor idle between two steps while the engine had
        work: what overlap removes). KV pool figures after each step: utilisation (tokens
        stored / capacity of the blocks held; 1 - internal fragmentation), summed to give a
        mean, and peak usage of the pool."""
        self.phase_times = {
            "schedule": 0.0,
            "execute": 0.0,
            "update": 0.0,
            "gap": 0.0,
            "propose": 0.0,
        }
        self.num_steps = self.num_gaps = 0
        self.kv_utilization_sum = 0.0
        self.kv_usage_peak = 0.0

    def record_compile(self, kind: str, seconds: float) -> None:
        """A constraint compiled (the grammar compiler's workers call this)."""
        self._compiles.append((kind, seconds))

    def record(self, done: ExecutedStep) -> float:
        """Record a step that ran; returns the executor's idle wait before it (0 for the first
        step after the engine got work)."""
        kv = self.core.kv_manager
        self.num_steps += 1
        self.kv_utilization_sum += kv.utilization
        self.kv_usage_peak = max(self.kv_usage_peak, kv.usage)
        self.phase_times["execute"] += done.end - done.start
        self.phase_times["propose"] += (
            done.result.propose_time
        )  # within execute: the next step's drafts
        # Idle time before the first step after the engine got work is not a gap.
        gap = 0.0
        if self._last_execute_end is not None and self._last_execute_end >= self.busy_since:
            gap = done.start - self._last_execute_end
            self.phase_times["gap"] += gap
            self.num_gaps += 1
        self._last_execute_end = done.end
        return gap

    def snapshot(self) -> SchedulerStats:
        s, kv = self.core.scheduler, self.core.kv_manager
        spec, host = s.spec_stats, kv.host_tier
        waiting = {f"L{lv}": s.waiting.count(lv) for lv in LEVELS}
        running = collections.Counter(f"L{r.level}" for r in s.running)
        return SchedulerStats(
            num_running=len(s.running),
            num_waiting=len(s.waiting),
            running_by_level={f"L{lv}": running.get(f"L{lv}", 0) for lv in LEVELS},
            waiting_by_level=waiting,
            kv_usage=kv.usage,
            kv_utilization=kv.utilization,
            kv_free_blocks=kv.num_free_blocks,
            kv_total_blocks=kv.num_blocks,
            host_free_blocks=host.num_free_host_blocks,
            host_total_blocks=host.num_host_blocks,
            num_swapped=host.num_swapped,
            prefix_queries=kv.stats.queries,
            prefix_hits=kv.stats.hits,
            num_preemptions=s.num_preemptions,
            preemptions_by_mode=dict(s.preemptions_by_mode),
            spec_num_drafts=spec.num_drafts,
            spec_num_draft_tokens=spec.num_draft_tokens,
            spec_num_accepted_tokens=spec.num_accepted_tokens,
            spec_accepted_per_pos=list(spec.accepted_per_pos),
            instance=self.instance_load(),
            grammar_compiles=self._take_compiles(),
            lora=self.core.lora_stats(),
        )

    def _take_compiles(self) -> list[tuple[str, float]]:
        n = len(self._compiles)
        taken, self._compiles[:n] = self._compiles[:n], []
        return taken

    def instance_load(self) -> dict:
        """The router's view of this instance's load (without model / role / elastic): the
        figures of `core/instance_state.py`, which the simulated instance uses too; the backlog
        scan and the cached-prefix list at most every `full_interval` while busy."""
        core = self.core
        s, kv = core.scheduler, core.kv_manager
        now = time.monotonic()
        load = {"max_model_len": core.max_model_len}
        if now - self._last_full >= self.full_interval or not core.has_unfinished_requests():
            self._last_full = now
            self._backlog = request_backlog(s)
            # newest first: the index keeps caching order; sent only when taken (the API side
            # keeps the last list), not with every step's stats
            load["cached_prefixes"] = kv.newest_cached_hashes(MAX_PREFIXES)
        return {**dataclasses.asdict(instance_load(s, self._backlog)), **load}
