"""Elastic P:D roles: which elastic instances switch between prefill and decode, from the
pressure on each side (prefill backlog and TTFT against decode KV load and ITL), or from a
time-of-day schedule. Pure: returns decisions; the caller drains an instance before it
switches, so no request in flight is lost or restarted."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tandem.cluster.policy.routing import InstanceState
from tandem.config import InstanceRole


@dataclass(slots=True, frozen=True)
class ElasticConfig:
    min_prefill: int = 1
    min_decode: int = 1
    prefill_backlog_tokens: int = (
        8192  # queued prompt tokens per prefill instance that mean "short of P"
    )
    decode_kv_usage: float = 0.8  # mean decode KV usage that means "short of D"
    ttft_slo: float | None = None  # s; a recent p90 above it adds prefill pressure
    itl_slo: float | None = None  # s; a recent p90 above it adds decode pressure
    hysteresis: float = 1.5  # one side's pressure must exceed the other's by this factor
    cooldown_s: float = 30.0  # between two switches
    persist_checks: int = (
        3  # a pressure signal must hold for this many checks in a row before a switch
    )
    min_dwell_s: float = 60.0  # an instance stays at least this long in the role it was switched to

    def __post_init__(self) -> None:
        if self.persist_checks < 1 or self.min_dwell_s < 0 or self.cooldown_s < 0:
            raise ValueError("elastic: persist_checks >= 1, min_dwell_s >= 0 and cooldown_s >= 0")


@dataclass(slots=True, frozen=True)
class TimeSchedule:
    """[(seconds since midnight, prefill instances)], e.g. day 2:8 and night 4:6 as
    [(8*3600, 2), (20*3600, 4)] for 10 instances."""

    entries: tuple[tuple[float, int], ...]

    def num_prefill(self, now: float) -> int:
        t = now % 86400
        past = [e for e in sorted(self.entries) if e[0] <= t]
        return (past[-1] if past else max(self.entries))[1]


def pressures(
    instances: Sequence[InstanceState],
    cfg: ElasticConfig,
    ttft_p90: float | None = None,
    itl_p90: float | None = None,
) -> tuple[float, float]:
    """(prefill, decode) pressure: 1.0 means a side is at its threshold."""
    p = [i for i in instances if i.role == InstanceRole.PREFILL and i.healthy]
    d = [i for i in instances if i.role == InstanceRole.DECODE and i.healthy]
    pp = (
        sum(i.waiting_prefill_tokens for i in p) / max(len(p), 1) / cfg.prefill_backlog_tokens
        if p
        else 2.0
    )
    dp = sum(i.kv_usage for i in d) / max(len(d), 1) / cfg.decode_kv_usage if d else 2.0
    if cfg.ttft_slo and ttft_p90 is not None:
        pp = max(pp, ttft_p90 / cfg.ttft_slo)
    if cfg.itl_slo and itl_p90 is not None:
        dp = max(dp, itl_p90 / cfg.itl_slo)
    return pp, dp


class RoleController:
    """Decides at most one switch per call, none within the cooldown of the last one, and -
    against flip-flopping within a burst - only on a pressure signal seen `persist_checks` calls
    in a row, moving only an instance that has been `min_dwell_s` in its role. A time schedule
    is followed as written (no persistence needed)."""

    def __init__(
        self, cfg: ElasticConfig = ElasticConfig(), schedule: TimeSchedule | None = None
    ) -> None:
        self.cfg, self.schedule = cfg, schedule
        self.last_switch = float("-inf")
        self.switches: list[tuple[float, str, str]] = []  # (time, instance, new role)
        self._streak = (0, 0)  # (direction wanted: +1 more prefill, -1 more decode, calls in a row)
        self._switched_at: dict[str, float] = {}  # instance -> when it last switched

    def decide(
        self,
        now: float,
        instances: Sequence[InstanceState],
        ttft_p90: float | None = None,
        itl_p90: float | None = None,
    ) -> tuple[str, str] | None:
        """(instance_id, new role) or None. Only healthy, non-draining elastic instances move."""
        live = [
            i
            for i in instances
            if i.healthy and i.role in (InstanceRole.PREFILL, InstanceRole.DECODE)
        ]
        # A draining instance is on its way to the other role: count it there.
        num_p = sum((i.role == InstanceRole.PREFILL) != i.draining for i in live)
        num_d = len(live) - num_p
        if self.schedule is not None:
            want, persisted = self.schedule.num_prefill(now) - num_p, True
        else:
            pp, dp = pressures(live, self.cfg, ttft_p90, itl_p90)
            want = (
                1
                if pp > 1.0 and pp > dp * self.cfg.hysteresis
                else -1
                if dp > 1.0 and dp > pp * self.cfg.hysteresis
                else 0
            )
            same = want != 0 and self._streak[0] == want
            self._streak = (want, self._streak[1] + 1 if same else int(want != 0))
            persisted = self._streak[1] >= self.cfg.persist_checks
        if now - self.last_switch < self.cfg.cooldown_s or not persisted:
            return None
        if want > 0 and num_d > self.cfg.min_decode:
            src, dst = InstanceRole.DECODE, InstanceRole.PREFILL
        elif want < 0 and num_p > self.cfg.min_prefill:
            src, dst = InstanceRole.PREFILL, InstanceRole.DECODE
        else:
            return None
        movable = [
            i
            for i in live
            if i.elastic
            and i.role == src
            and not i.draining
            and now - self._switched_at.get(i.instance_id, float("-inf")) >= self.cfg.min_dwell_s
        ]
        if not movable:
            return None
        # The least busy one drains fastest.
        inst = min(movable, key=lambda i: (i.num_running + i.num_waiting, i.kv_usage))
        self.last_switch = self._switched_at[inst.instance_id] = now
        self._streak = (0, 0)
        self.switches.append((now, inst.instance_id, dst))
        return inst.instance_id, dst
