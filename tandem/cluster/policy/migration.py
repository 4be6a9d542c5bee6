"""When a decode instance runs short of KV, move one of its decoding requests - its KV goes
along and generation continues - to a decode instance with room for it. Pure: a function of
the instances' reported states and the requests decoding on them; the router's loop
(`migrate_loop.py`) carries the move out. The target must stay well under the shortage mark
after taking the request, and a moved request stays put for a cooldown, so nothing ping-pongs."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from tandem.cluster.policy.routing import InstanceState
from tandem.config import InstanceRole


@dataclass(slots=True, frozen=True)
class MigrationConfig:
    enabled: bool = True
    interval_s: float = 0.5  # between two checks
    kv_usage: float = 0.9  # a decode instance at or above this KV usage is short
    preempted: int = 1  # ... or with this many preempted requests waiting (0: not a signal)
    target_kv_usage: float = (
        0.8  # a target's KV usage once it holds the request's quota stays at or under this
    )
    cooldown_s: float = 30.0  # a moved request is not moved again within this

    def __post_init__(self) -> None:
        if not 0 < self.target_kv_usage < self.kv_usage <= 1:
            raise ValueError(
                "migration: 0 < target_kv_usage < kv_usage <= 1 (a target must not become short), "
                f"got target_kv_usage={self.target_kv_usage}, kv_usage={self.kv_usage}"
            )
        if self.interval_s <= 0 or self.cooldown_s < 0 or self.preempted < 0:
            raise ValueError("migration: interval_s > 0, cooldown_s >= 0 and preempted >= 0")


@dataclass(slots=True, frozen=True)
class DecodingRequest:
    """A request decoding on a decode instance, as the router sees it."""

    request_id: str
    instance_id: str
    num_tokens: int  # tokens whose KV it holds: prompt + generated so far
    kv_tokens: int  # its quota: prompt + max_tokens (prompt + 1 without max_tokens)


@dataclass(slots=True, frozen=True)
class Migration:
    request_id: str
    source: str
    target: str


def short_of_kv(s: InstanceState, cfg: MigrationConfig) -> bool:
    return s.kv_usage >= cfg.kv_usage or (cfg.preempted > 0 and s.num_preempted >= cfg.preempted)


def usage_after(s: InstanceState, tokens: int) -> float:
    """KV usage of `s` once it holds `tokens` more; above 1 when they do not fit. The pool's
    capacity is free tokens / (1 - usage), both as reported."""
    if tokens > s.kv_free_tokens or s.kv_free_tokens <= 0:
        return float("inf")
    return 1.0 - (s.kv_free_tokens - tokens) / (s.kv_free_tokens / (1.0 - s.kv_usage))


def choose_migration(
    instances: Sequence[InstanceState],
    requests: Iterable[DecodingRequest],
    cfg: MigrationConfig,
    now: float,
    moved_at: Mapping[str, float],
) -> Migration | None:
    """At most one move. Sources: healthy decode instances short of KV, the fullest first.
    From a source, the request holding the most KV that some target can take (room for
    max(quota, KV held), usage after it <= target_kv_usage) and that has not moved within
    the cooldown (`moved_at`: request id -> time of its last move); the target with the most
    free KV. Targets: available decode instances not short themselves."""
    decode = [s for s in instances if s.role == InstanceRole.DECODE and s.healthy]
    targets = [s for s in decode if s.available and not short_of_kv(s, cfg)]
    if not targets:
        return None
    by_source: dict[str, list[DecodingRequest]] = {}
    for r in requests:
        if now - moved_at.get(r.request_id, float("-inf")) >= cfg.cooldown_s:
            by_source.setdefault(r.instance_id, []).append(r)
    for src in sorted((s for s in decode if short_of_kv(s, cfg)), key=lambda s: -s.kv_usage):
        for r in sorted(by_source.get(src.instance_id, ()), key=lambda r: -r.num_tokens):
            need = max(r.kv_tokens, r.num_tokens)
            fits = [
                t
                for t in targets
                if t.instance_id != src.instance_id and usage_after(t, need) <= cfg.target_kv_usage
            ]
            if fits:
                dst = max(fits, key=lambda t: (t.kv_free_tokens, -t.num_running))
                return Migration(r.request_id, src.instance_id, dst.instance_id)
    return None
