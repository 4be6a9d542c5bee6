"""The load an instance reports to a router (GET /tandem/state; `cluster/policy/routing.py`'s
`InstanceState`), built in one place: the real instance (`cluster/instance.py`) and the
simulated one (`sim/instance.py`) both call `instance_load`, so simulated routing and elastic
pressure see the load the router sees, chunked prefills and preempted requests included."""

from __future__ import annotations

from dataclasses import dataclass

from tandem.config.request_class import LEVELS
from tandem.core.scheduler import Scheduler


@dataclass(slots=True, frozen=True)
class Backlog:
    """The part of the load that walks every request (O(requests))."""

    prefill_tokens: int  # prompt tokens not yet computed: waiting requests', running ones' rest
    num_preempted: int  # waiting requests that were preempted (they lost their seat or KV)


@dataclass(slots=True, frozen=True)
class InstanceLoad:
    num_waiting: int
    num_running: int
    waiting_by_level: dict[str, int]  # "L1", "L2", "L3" -> waiting requests
    waiting_prefill_tokens: int
    num_preempted: int
    kv_usage: float  # share of the KV pool in use
    kv_free_tokens: int
    block_size: int


def request_backlog(scheduler: Scheduler) -> Backlog:
    """A waiting request counts all its uncomputed tokens (a preempted one's output too: it is
    recomputed), a running one the rest of its prompt (a chunked prefill under way)."""
    waiting = sum(r.num_tokens - r.num_computed_tokens for r in scheduler.waiting)
    running = sum(max(r.num_prompt_tokens - r.num_computed_tokens, 0) for r in scheduler.running)
    return Backlog(waiting + running, sum(1 for r in scheduler.waiting if r.num_preemptions))


def instance_load(scheduler: Scheduler, backlog: Backlog | None = None) -> InstanceLoad:
    """The load now. `backlog`: one taken earlier by `request_backlog` (the real instance takes
    it at most every `full_interval` while busy), or None to take it now."""
    if backlog is None:
        backlog = request_backlog(scheduler)
    kv = scheduler.kv
    return InstanceLoad(
        num_waiting=len(scheduler.waiting),
        num_running=len(scheduler.running),
        waiting_by_level={f"L{lv}": scheduler.waiting.count(lv) for lv in LEVELS},
        waiting_prefill_tokens=backlog.prefill_tokens,
        num_preempted=backlog.num_preempted,
        kv_usage=kv.usage,
        kv_free_tokens=kv.num_free_blocks * kv.block_size,
        block_size=kv.block_size,
    )
