"""Where a request goes: the instance holding its longest cached prefix unless that instance is
overloaded, else the least loaded one; under P/D, a prefill and a decode instance, or an idle
decode instance alone for a short prompt. Pure functions of reported instance state, so the
router and the simulator make the very same choices."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from tandem.config import InstanceRole


@dataclass(slots=True)
class InstanceState:
    """What an instance reports to the router (plus what the router has sent it since)."""

    instance_id: str
    model: str
    role: InstanceRole = InstanceRole.COLOCATED
    elastic: bool = False  # may switch between prefill and decode
    healthy: bool = True
    draining: bool = False  # finishing in-flight work before a role switch: takes nothing new
    num_waiting: int = 0
    num_running: int = 0
    waiting_prefill_tokens: int = 0  # prompt tokens queued and not yet computed
    kv_usage: float = 0.0  # share of the KV pool in use
    kv_free_tokens: int = 0
    cached_prefixes: frozenset[int] = field(
        default_factory=frozenset
    )  # hashes of cached prompt blocks
    num_preempted: int = 0  # waiting requests that were preempted (they lost their seat or KV)

    @property
    def available(self) -> bool:
        return self.healthy and not self.draining


@dataclass(slots=True, frozen=True)
class RoutingWeights:
    prefix: float = 1.0  # score of a full prefix hit
    load: float = 1.0  # score lost per unit of load
    load_tokens: int = 4096  # queued prompt tokens that count as one unit of load
    overload_kv_usage: float = (
        0.95  # above this (or overload_waiting queued) a cache hit earns nothing
    )
    overload_waiting: int = 64
    short_prefill_tokens: int = (
        256  # P/D: an idle decode instance prefills prompts up to this itself
    )


def prefix_match(prefix_hashes: Sequence[int], cached: frozenset[int]) -> int:
    """Leading blocks of the prompt whose chained hash the instance holds."""
    n = 0
    for h in prefix_hashes:
        if h not in cached:
            break
        n += 1
    return n


def load(inst: InstanceState, w: RoutingWeights) -> float:
    return inst.waiting_prefill_tokens / w.load_tokens + inst.kv_usage


def overloaded(inst: InstanceState, w: RoutingWeights) -> bool:
    return inst.kv_usage >= w.overload_kv_usage or inst.num_waiting >= w.overload_waiting


def choose_instance(
    instances: Iterable[InstanceState],
    prefix_hashes: Sequence[int] = (),
    w: RoutingWeights = RoutingWeights(),
    role: InstanceRole | None = None,
) -> InstanceState | None:
    """Best available instance (of `role`, when given) by prefix hit minus load; None when
    no instance can take the request. Ties go to fewer running requests, then list order."""
    best, best_key = None, None
    for i, inst in enumerate(instances):
        if not inst.available or (role is not None and inst.role != role):
            continue
        hit = 0.0
        if prefix_hashes and not overloaded(inst, w):
            hit = prefix_match(prefix_hashes, inst.cached_prefixes) / len(prefix_hashes)
        key = (overloaded(inst, w), -(w.prefix * hit - w.load * load(inst, w)), inst.num_running, i)
        if best_key is None or key < best_key:
            best, best_key = inst, key
    return best


def choose_decode(instances: Iterable[InstanceState], kv_tokens: int) -> InstanceState | None:
    """The decode instance with the most free KV that can reserve `kv_tokens` (the request's
    quota, taken before the transfer); None when none has room now."""
    fits = [
        d
        for d in instances
        if d.available and d.role == InstanceRole.DECODE and d.kv_free_tokens >= kv_tokens
    ]
    return max(fits, key=lambda d: (d.kv_free_tokens, -d.num_running), default=None)


def route_pd(
    instances: Sequence[InstanceState],
    prompt_tokens: int,
    kv_tokens: int,
    prefix_hashes: Sequence[int] = (),
    w: RoutingWeights = RoutingWeights(),
) -> tuple[InstanceState | None, InstanceState | None]:
    """(prefill, decode) for a disaggregated request. prefill is None when an idle decode
    instance runs this short prompt itself; decode is None when no decode instance has room
    for the request's KV quota yet (the caller waits and asks again)."""
    decode = choose_decode(instances, kv_tokens)
    if (
        decode is not None
        and prompt_tokens <= w.short_prefill_tokens
        and decode.num_waiting == 0
        and decode.waiting_prefill_tokens == 0
    ):
        return None, decode
    return choose_instance(instances, prefix_hashes, w, role=InstanceRole.PREFILL), decode
