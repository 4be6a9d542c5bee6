"""Token accounting of one schedule() call, per level."""
from __future__ import annotations

from dataclasses import dataclass, field

from tandem.core.outputs import SchedulerOutput
from tandem.core.request import Request


@dataclass(slots=True)
class StepBudget:
    """Token accounting of one schedule() call."""

    out: SchedulerOutput
    budget: int
    l1_cap: int  # L1's tokens this step: the budget less L2's reserve
    lower_prefill_cap: int  # L2 + L3 prompt tokens: their share only while L1 traffic is present
    used: int = 0
    l1_used: int = 0
    lower_prefill_used: int = 0
    admitted: list[Request] = field(default_factory=list)
    l2_hold: tuple[int, int] | None = None  # seats and blocks L1 leaves L2, computed once

    def cap(self, level: int, pending: int) -> int:
        """Tokens a request of `level` with `pending` uncomputed tokens may take now.
        Lower-level decodes always fit the budget: they barely lengthen a step."""
        left = self.budget - self.used
        if level == 1:
            return min(left, self.l1_cap - self.l1_used)
        if pending <= 1:
            return left
        return min(left, self.lower_prefill_cap - self.lower_prefill_used)
