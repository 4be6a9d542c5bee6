"""Token accounting of one schedule() call, per level, and the L1 throttle's adaptation."""

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
    lower_prefill_cap: int  # L2 + L3 prompt tokens: throttled while L1 traffic is present
    throttled: bool = False  # lower_prefill_cap is the L1 throttle (Scheduler.observe_step)
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

    def commit(self, req: Request, num_new: int, pending: int) -> None:
        """Schedule `num_new` tokens of `req`, which has `pending` tokens to compute (its known
        and in-flight ones past its computed ones: the caller has the figure), in this step."""
        out = self.out
        out.num_scheduled_tokens[req.request_id] = num_new
        out.total_num_scheduled_tokens += num_new
        self.used += num_new
        if req.level == 1:
            self.l1_used += num_new
        elif pending > 1:
            self.lower_prefill_used += num_new  # a prompt chunk, even of one token
        req.num_computed_tokens += num_new
        if num_new >= pending:  # > with drafts
            req.num_output_placeholders += 1  # this step samples a token, known only after it ran


def adapt_throttle(
    tokens: int, used: int, seconds: float, target: float, floor: int, ceiling: int
) -> int:
    """Lower-level prompt tokens per step under the L1 throttle, after a step that held `used`
    of them under a throttle of `tokens` and took `seconds` against a `target`. Over the target:
    fewer, in proportion (decodes may be what made it long: L1 comes first). Under it: more,
    but only if the throttle bounded the step. A chunk late in a long prompt costs more (its
    attention reads the whole prefix), so it gets fewer tokens, which a fixed share cannot do.
    Within [floor, ceiling], at most 2x per step."""
    ratio = min(2.0, max(0.5, target / seconds))
    if ratio < 1.0:
        # From what the step held: under async scheduling it was planned before the last
        # adaptation, which may have shrunk the throttle already.
        new = min(tokens, int(used * ratio))
    elif used >= tokens:
        new = int(tokens * ratio)
    else:
        return tokens  # under the target, and the throttle did not bound the step: no evidence
    return min(ceiling, max(floor, new))
