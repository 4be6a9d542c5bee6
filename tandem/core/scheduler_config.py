"""What the scheduler is told: budgets, policy and preemption settings, validated once."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048
    policy: str = "fcfs"  # fcfs | multilevel
    queue_order: str = "fcfs"  # within a level: fcfs | spf (shortest prompt first, with aging)
    l2_min_share: float = 0.2  # of the token budget and the seats, whenever L2 has work
    max_preemptions: int = 4  # per request, before it stops being chosen as a victim
    preemption_mode: str = "auto"  # auto | swap | recompute
    swap_cost_per_token: float = 2e-5  # s to move one token's KV out and back (auto mode)
    recompute_cost_per_token: float = 1e-3  # s to prefill one token again (auto mode)
    # Lower levels keep prefilling only their share for this long after interactive (L1)
    # traffic was last seen, so an L1 request arriving in a lull does not wait behind a
    # full-budget prefill step.
    l1_hold_s: float = 2.0
    # While L1 traffic is present, lower levels prefill per step only as many tokens as keep a
    # step about this long (seconds), adapted from measured step times (Scheduler.observe_step),
    # and never fewer than their share. None: exactly their share of the token budget.
    l1_step_time: float | None = None
    # Speculative decoding (core/spec_decode.py): drafts verified per request and step at most
    # (0: as many as proposed), and whether AdaptiveK chooses fewer (down to 0) from measured
    # acceptance and step costs.
    num_speculative_tokens: int = 0
    adaptive_speculation: bool = True
    # A draft model proposes in the step that samples, writing its KV at the k positions after
    # the sampled token: slots allocated past the step's own (0: n-gram, or no speculation).
    num_lookahead_tokens: int = 0

    def __post_init__(self) -> None:
        if self.policy not in ("fcfs", "multilevel"):
            raise ValueError(f"scheduler policy must be fcfs or multilevel, got {self.policy!r}")
        if self.preemption_mode not in ("auto", "swap", "recompute"):
            raise ValueError(f"preemption_mode must be auto, swap or recompute, got {self.preemption_mode!r}")
        if self.l1_hold_s < 0:
            raise ValueError(f"l1_hold_s must be >= 0, got {self.l1_hold_s}")
        if self.l1_step_time is not None and self.l1_step_time <= 0:
            raise ValueError(f"l1_step_time must be > 0 seconds, got {self.l1_step_time}")
        if not 0.0 <= self.l2_min_share < 1.0:
            raise ValueError(f"l2_min_share must be in [0, 1), got {self.l2_min_share}")
        if self.policy == "multilevel" and self.l2_min_share > 0 and self.max_num_batched_tokens < 2:
            # L2's reserve must be at least one token beside L1's, or an L1 short of blocks
            # can preempt itself forever behind an L2 that never advances.
            raise ValueError("the multilevel policy with l2_min_share > 0 needs max_num_batched_tokens >= 2")
