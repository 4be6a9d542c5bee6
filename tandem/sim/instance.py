"""One simulated instance: the real Scheduler and KVCacheManager over a SimulatedExecutor,
stepped on the cluster's virtual clock. Steps in which nothing can change but one more
decode token per request are coalesced (see fast_forward.py); results are the same."""

from __future__ import annotations

from collections.abc import Callable

from tandem.cluster.policy.routing import InstanceState
from tandem.config import CacheConfig, InstanceRole, SchedulerConfig
from tandem.core.instance_state import instance_load
from tandem.core.kv_cache_manager import KVCacheManager
from tandem.core.kv_connector.pd import PDConnector
from tandem.core.outputs import ModelRunnerOutput, SchedulerOutput
from tandem.core.preemption import PreemptionCosts
from tandem.core.queues import classify
from tandem.core.request import Request
from tandem.core.sampling_params import SamplingParams
from tandem.core.scheduler import Scheduler
from tandem.sim.cost_model import CostModel
from tandem.sim.executor import SimulatedExecutor
from tandem.sim.fast_forward import fast_forward
from tandem.sim.request import SimRequest


class SimInstance:
    def __init__(
        self,
        instance_id: str,
        cost: CostModel,
        cfg: SchedulerConfig,
        cache: CacheConfig,
        clock: Callable[[], float],
        role: InstanceRole = InstanceRole.COLOCATED,
        elastic: bool = False,
        max_model_len: int | None = None,
    ) -> None:
        self.instance_id, self.cfg, self.clock = instance_id, cfg, clock
        self.role, self.elastic, self.draining, self.next_role = role, elastic, False, None
        self.executor = SimulatedExecutor(cost)
        bs = self.executor.block_size
        self.kv = KVCacheManager(
            self.executor.num_kv_blocks,
            bs,
            cache.enable_prefix_caching,
            cache.max_prefix_tokens,
            cache.min_match_length,
            self.executor.num_host_blocks,
        )
        capacity = self.executor.num_kv_blocks * bs
        self.max_model_len = min(max_model_len or capacity, capacity)
        self.scheduler = Scheduler(
            cfg,
            self.kv,
            clock,
            self.max_model_len,
            PreemptionCosts(*self.executor.preemption_costs()),
        )
        # KV sent here by a prefill instance (P/D)
        self.kv_connector = PDConnector(self.kv.coordinator, self.scheduler.requests)
        self.sim_reqs: dict[str, SimRequest] = {}
        self.on_finish: Callable[[SimRequest, str, float], None] = lambda r, rid, t: None
        self.busy = False
        self.reserved_tokens = 0  # decode side: KV quota promised to transfers in flight
        self._step: tuple[SchedulerOutput, ModelRunnerOutput] | None = None
        self.num_steps = self.num_coalesced = 0
        self.busy_time = self.usage_time = 0.0  # seconds stepping; integral of KV usage over them
        self.usage_peak = 0.0

    # ---- admission ----------------------------------------------------------------
    def add(self, sim: SimRequest, prompt: list[int], max_tokens: int, req_id: str) -> None:
        """Queue `sim` (as `req_id`; a P/D request has one per side). Raises ValueError like
        the real engine when the prompt cannot be served."""
        priority = sim.priority or classify(
            len(prompt), max_tokens, self.cfg.l1_max_prompt_tokens, self.cfg.l1_max_tokens
        )
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        self.scheduler.add_request(
            Request(req_id, prompt, params, self.clock(), None, priority=priority)
        )
        self.sim_reqs[req_id] = sim
        sim.instances.append(self.instance_id)

    @property
    def num_unfinished(self) -> int:
        return self.scheduler.num_unfinished

    def state(self, model: str) -> InstanceState:
        """What the router would poll from this instance (the same builder as the real one);
        KV promised to transfers in flight is not free."""
        load = instance_load(self.scheduler)
        return InstanceState(
            self.instance_id,
            model,
            self.role,
            self.elastic,
            True,
            self.draining,
            load.num_waiting,
            load.num_running,
            load.waiting_prefill_tokens,
            load.kv_usage,
            max(load.kv_free_tokens - self.reserved_tokens, 0),
            self.kv.pool.cached_hashes,
            load.num_preempted,
        )

    # ---- stepping -----------------------------------------------------------------
    def start_step(self, now: float, horizon: float, coalesce: bool = True) -> float | None:
        """Begin the next step at `now`; returns when it ends (None: nothing to run). With
        `coalesce`, a run of pure-decode steps ending before `horizon` (the next event that
        could change this instance) is applied in one go."""
        if coalesce:
            end = fast_forward(self, now, horizon)
            if end is not None:
                self.busy = True
                self._step = None
                return end
        so = self.scheduler.schedule()
        for new in so.scheduled_new_reqs:
            sim = self.sim_reqs[new.req_id]
            if sim.first_scheduled is None:
                sim.first_scheduled = now
            if sim.kv_reservation is not None and new.req_id.startswith("d:"):
                # admitted: it holds its own references now
                self.kv_connector.release(sim.kv_reservation)
                sim.kv_reservation = None
        if so.is_empty:
            self.busy = False
            return None
        result = self.executor.execute_model(so)
        self._step = (so, result)
        self.busy = True
        self.account(result.execute_time, self.kv.usage)
        return now + result.execute_time

    def account(self, seconds: float, usage: float) -> None:
        self.num_steps += 1
        self.busy_time += seconds
        self.usage_time += usage * seconds
        self.usage_peak = max(self.usage_peak, usage)

    def end_step(self, now: float) -> None:
        """Apply the step's outputs at its end time: tokens, finishes."""
        self.busy = False
        if self._step is None:
            return  # a coalesced run: applied when it began
        so, result = self._step
        self._step = None
        self.scheduler.observe_step(so, result.execute_time)
        self.scheduler.planner.observe_step(so, result.execute_time)
        for out in self.scheduler.update_from_output(so, result):
            sim = self.sim_reqs[out.req_id]
            for _ in out.new_token_ids:
                sim.on_token(now)
            if out.finish_reason is not None:
                del self.sim_reqs[out.req_id]
                self.on_finish(sim, out.req_id, now)
