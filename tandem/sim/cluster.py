"""The discrete-event cluster simulator: simulated instances running the real scheduler and
KV pool, placed by the real routing policy (tandem.cluster.policy.routing) and, under P/D, the real
prefill/decode assignment and elastic role controller (tandem.cluster.policy.elastic). Events are
arrivals, step ends, KV transfers and controller ticks, on one virtual clock."""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field

from tandem.cluster.policy.elastic import ElasticConfig, RoleController, TimeSchedule
from tandem.cluster.policy.routing import RoutingWeights, choose_instance, route_pd
from tandem.config import EngineConfig, InstanceRole
from tandem.sim.cost_model import CostModel
from tandem.sim.executor import SIM_TOKEN
from tandem.sim.instance import SimInstance
from tandem.sim.request import SimRequest

MODES = ("colocated", "pd", "elastic")
_STEP, _TRANSFER, _TICK, _RETRY = 0, 1, 2, 3


@dataclass(slots=True)
class ClusterConfig:
    num_instances: int = 1
    mode: str = "colocated"  # colocated | pd (fixed roles) | elastic (P/D, roles move)
    num_prefill: int = 1  # pd / elastic: prefill instances at the start; the rest decode
    weights: RoutingWeights = field(default_factory=RoutingWeights)
    elastic: ElasticConfig = field(default_factory=ElasticConfig)
    schedule: TimeSchedule | None = None
    controller_interval: float = 5.0  # s between role-controller decisions
    pending_retry: float = 0.05  # s between placement retries while no decode instance has room
    coalesce: bool = True  # fast-forward pure-decode runs (same results, much faster)
    frontend_delay: float = 0.0  # s from a client's send to the engine's queue (HTTP, tokenising)
    model: str = "model"

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        if self.num_instances < 1:
            raise ValueError("a cluster needs at least one instance")
        if self.mode != "colocated" and not 1 <= self.num_prefill < self.num_instances:
            raise ValueError(
                "P/D needs 1 <= prefill < instances, "
                f"got {self.num_prefill} of {self.num_instances}"
            )


class ClusterSim:
    def __init__(self, cost: CostModel, engine: EngineConfig, cfg: ClusterConfig) -> None:
        self.cost, self.cfg, self.now = cost, cfg, 0.0
        clock = lambda: self.now  # noqa: E731 - the one virtual clock every policy object reads
        pd = cfg.mode != "colocated"
        self.instances = [
            SimInstance(
                f"i{i}",
                cost,
                engine.scheduler_config,
                engine.cache_config,
                clock,
                role=(InstanceRole.PREFILL if i < cfg.num_prefill else InstanceRole.DECODE)
                if pd
                else InstanceRole.COLOCATED,
                elastic=cfg.mode == "elastic",
                max_model_len=engine.model_config.max_model_len,
            )
            for i in range(cfg.num_instances)
        ]
        for inst in self.instances:
            inst.on_finish = self._on_finish
        self.controller = (
            RoleController(cfg.elastic, cfg.schedule) if cfg.mode == "elastic" else None
        )
        self._events: list = []
        self._seq = itertools.count()
        self._step_end: dict[str, float] = {}
        self._prefill_only: dict[str, int] = {i.instance_id: 0 for i in self.instances}
        self.pending: list[SimRequest] = []  # P/D: waiting for a decode instance with room
        self._arrivals_left = 0
        self._retry_scheduled = False
        self.transfer_bytes = 0
        self.role_switches: list[tuple[float, str, str]] = []

    # ---- events -------------------------------------------------------------------
    def _push(self, t: float, kind: int, obj) -> None:
        heapq.heappush(self._events, (t, next(self._seq), kind, obj))

    def run(self, requests: list[SimRequest], progress=None) -> list[SimRequest]:
        arrivals = sorted(requests, key=lambda r: r.arrival)
        i, n = 0, len(arrivals)
        self._arrivals_left = n
        if self.controller is not None:
            self._push(self.cfg.controller_interval, _TICK, None)
        while i < n or self._busy():
            t_arr = arrivals[i].arrival + self.cfg.frontend_delay if i < n else float("inf")
            if self._events and self._events[0][0] < t_arr:
                self.now, _, kind, obj = heapq.heappop(self._events)
                {
                    _STEP: self._step_done,
                    _TRANSFER: self._transfer_done,
                    _TICK: self._tick,
                    _RETRY: self._retry,
                }[kind](obj)
            else:
                self.now = t_arr
                self._arrive(arrivals[i])
                i += 1
                self._arrivals_left = n - i
                if progress is not None:
                    progress.update(1)
            self._kick(arrivals[i].arrival + self.cfg.frontend_delay if i < n else float("inf"))
        return requests

    def _busy(self) -> bool:
        return any(k != _TICK for _, _, k, _ in self._events) or bool(self.pending)

    def _retry(self, _) -> None:
        """Place the requests waiting for a decode instance; when nothing anywhere can free
        room any more, end them with an error rather than wait forever."""
        self._retry_scheduled = False
        self._retry_pending()
        if not self.pending:
            return
        if (
            any(i.busy or i.num_unfinished for i in self.instances)
            or self._arrivals_left
            or any(k == _TRANSFER for _, _, k, _ in self._events)
        ):
            self._schedule_retry()
            return
        for sim in self.pending:
            sim.error = "no decode instance can hold this request's KV"
        self.pending = []

    def _schedule_retry(self) -> None:
        if not self._retry_scheduled:
            self._retry_scheduled = True
            self._push(self.now + self.cfg.pending_retry, _RETRY, None)

    def _horizon(self, next_arrival: float) -> float:
        """The earliest moment anything outside an instance could change it."""
        h = next_arrival
        for t, _, kind, _ in self._events:
            if kind != _STEP:
                h = min(h, t)
        if self.pending:
            h = min(h, self.now + self.cfg.pending_retry)
        for inst_id, count in self._prefill_only.items():
            if count:  # a prefill in flight will start a transfer when its step ends
                h = min(h, self._step_end.get(inst_id, self.now) + self.cost.kv_transfer_time(0))
        return h

    def _kick(self, next_arrival: float) -> None:
        """Start a step on every idle instance that has work."""
        horizon = None
        for inst in self.instances:
            if inst.busy or not inst.num_unfinished:
                continue
            if horizon is None:
                horizon = self._horizon(next_arrival)
            end = inst.start_step(self.now, horizon, self.cfg.coalesce)
            if end is not None:
                self._step_end[inst.instance_id] = end
                self._push(end, _STEP, inst)

    def _step_done(self, inst: SimInstance) -> None:
        inst.end_step(self.now)
        if inst.draining and not inst.num_unfinished and not inst.reserved_tokens:
            inst.role, inst.draining = inst.next_role, False
        if self.pending and inst.role == InstanceRole.DECODE:
            self._retry_pending()

    def _tick(self, _) -> None:
        for inst in self.instances:
            if (
                inst.draining
                and not inst.num_unfinished
                and not inst.busy
                and not inst.reserved_tokens
            ):
                inst.role, inst.draining = inst.next_role, False
        states = [i.state(self.cfg.model) for i in self.instances]
        decision = self.controller.decide(self.now, states)
        if decision is not None:
            inst = next(i for i in self.instances if i.instance_id == decision[0])
            inst.draining, inst.next_role = True, decision[1]
            self.role_switches.append((self.now, *decision))
            if not inst.num_unfinished and not inst.busy and not inst.reserved_tokens:
                inst.role, inst.draining = inst.next_role, False
        if self._busy() or self._arrivals_left:
            self._push(self.now + self.cfg.controller_interval, _TICK, None)

    # ---- placement ----------------------------------------------------------------
    def _arrive(self, sim: SimRequest) -> None:
        if sim.prompt_len < 1 or sim.output_len < 1:
            sim.error = "empty prompt or output"
            return
        if self.cfg.mode == "colocated":
            inst = choose_instance(
                [i.state(self.cfg.model) for i in self.instances],
                self._prefix(sim),
                self.cfg.weights,
            )
            self._add(inst, sim, sim.prompt_token_ids(), sim.output_len, f"c:{sim.index}")
        else:
            self._place_pd(sim)

    def _prefix(self, sim: SimRequest) -> list[int]:
        return sim.prefix_hashes(self.cost.block_size, 4096)

    def _add(
        self, inst_state, sim: SimRequest, prompt: list[int], max_tokens: int, req_id: str
    ) -> bool:
        if inst_state is None:
            sim.error = "no instance available"
            return False
        inst = self._by_id(inst_state.instance_id)
        try:
            inst.add(sim, prompt, max_tokens, req_id)
        except ValueError as e:
            sim.error = str(e)
            return False
        return True

    def _by_id(self, instance_id: str) -> SimInstance:
        return next(i for i in self.instances if i.instance_id == instance_id)

    def _place_pd(self, sim: SimRequest) -> bool:
        states = [i.state(self.cfg.model) for i in self.instances]
        prefill, decode = route_pd(
            states,
            sim.prompt_len,
            sim.prompt_len + sim.output_len,
            self._prefix(sim),
            self.cfg.weights,
        )
        if decode is None:
            if sim.prompt_len + sim.output_len > max(i.max_model_len for i in self.instances):
                sim.error = f"{sim.prompt_len + sim.output_len} tokens do not fit any instance"
                return True
            self.pending.append(sim)
            self._schedule_retry()
            return False
        if prefill is None:  # an idle decode instance runs this short prompt itself
            self._add(decode, sim, sim.prompt_token_ids(), sim.output_len, f"c:{sim.index}")
            return True
        target = self._by_id(decode.instance_id)
        target.reserved_tokens += sim.prompt_len + sim.output_len
        sim.decode_target = target
        if self._add(prefill, sim, sim.prompt_token_ids(), 1, f"p:{sim.index}"):
            self._prefill_only[prefill.instance_id] += 1
        else:
            target.reserved_tokens -= sim.prompt_len + sim.output_len
        return True

    def _retry_pending(self) -> None:
        waiting, self.pending = self.pending, []
        for sim in waiting:
            if not self._place_pd(sim):
                self.pending = self.pending + waiting[waiting.index(sim) + 1 :]
                return

    # ---- P/D handoff ----------------------------------------------------------------
    def _on_finish(self, sim: SimRequest, req_id: str, now: float) -> None:
        if not req_id.startswith("p:"):
            sim.finished = now
            return
        self._prefill_only[sim.instances[-1]] -= 1
        if sim.output_len <= 1:
            sim.decode_target.reserved_tokens -= sim.prompt_len + sim.output_len
            sim.finished = now
            return
        # As the real decode instance does just before the transfer: hold blocks for the
        # prompt's whole blocks (pinning those it caches already); only the rest move.
        sim.kv_reservation = sim.decode_target.kv_connector.reserve(sim.prompt_token_ids())
        res = sim.kv_reservation
        moved = res.num_fresh_blocks * self.cost.block_size if res is not None else 0
        seconds = self.cost.kv_transfer_time(moved)
        sim.transfer_s += seconds
        self.transfer_bytes += moved * self.cost.kv_bytes_per_token
        self._push(now + seconds, _TRANSFER, sim)

    def _transfer_done(self, sim: SimRequest) -> None:
        """The KV has landed: index it, and queue the continuation (prompt + first token),
        which the prefix lookup finds; the pin is dropped once it is admitted. With no
        reservation (the pool was short) the decode side recomputes the prompt."""
        target = sim.decode_target
        target.reserved_tokens -= sim.prompt_len + sim.output_len
        if sim.kv_reservation is not None:
            target.kv_connector.commit(sim.kv_reservation, sim.kv_reservation.num_blocks)
        if (
            not self._add(
                target.state(self.cfg.model),
                sim,
                sim.prompt_token_ids() + [SIM_TOKEN],
                sim.output_len - 1,
                f"d:{sim.index}",
            )
            and sim.kv_reservation is not None
        ):
            target.kv_connector.release(sim.kv_reservation)
            sim.kv_reservation = None
