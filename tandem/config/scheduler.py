"""The scheduler section: step budgets, the policy and preemption settings the core scheduler
(core/scheduler.py) and the simulator run with. What the engine measures at start (the costs
of swap and recompute, the KV pool's token capacity) is passed beside it, not set here."""

from __future__ import annotations

from dataclasses import dataclass

from tandem.config.option import Choice, option


class SchedulingPolicy(Choice):
    FCFS = "fcfs"  # the baseline every benchmark compares with
    # interactive (L1) first, a guaranteed share for L2, L3 on what is left
    MULTILEVEL = "multilevel"


class QueueOrder(Choice):
    FCFS = "fcfs"  # by arrival
    SPF = "spf"  # shortest prompt first, with aging


class PreemptionMode(Choice):
    AUTO = "auto"  # the cheaper of the two for each victim
    SWAP = "swap"
    RECOMPUTE = "recompute"


@dataclass(slots=True)
class SchedulerConfig:
    yaml_section = "scheduler"  # serving.scheduler takes every field here by name

    max_num_seqs: int = option(128, "requests in a step at most", unit="requests")
    max_num_batched_tokens: int = option(2048, "tokens in a step at most", unit="tokens")
    scheduling_policy: SchedulingPolicy = option(
        SchedulingPolicy.FCFS,
        "fcfs, or multilevel (short / priority requests first, with a floor for the rest)",
        yaml="scheduler.policy",
    )
    queue_order: QueueOrder = option(
        QueueOrder.FCFS, "within a level: arrival (fcfs), or shortest prompt first (spf)"
    )
    l2_min_share: float = option(
        0.2,
        "multilevel: share of a step's tokens and seats lower levels keep whenever L2 has work",
        unit="fraction",
    )
    max_preemptions: int = option(
        4, "times a request is preempted before it stops being chosen as a victim"
    )
    preemption_mode: PreemptionMode = option(
        PreemptionMode.AUTO,
        "when KV runs out: swap to host memory, recompute, or auto (the cheaper of the two per "
        "request)",
    )
    l1_max_prompt_tokens: int = option(
        256,
        "unlabelled requests with a prompt this short (and a short max_tokens) go to L1",
        unit="tokens",
    )
    l1_max_tokens: int = option(
        256,
        "unlabelled requests with at most this max_tokens (and a short prompt) go to L1",
        unit="tokens",
    )
    # Lower levels keep prefilling only their share for this long after interactive (L1)
    # traffic was last seen, so an L1 request arriving in a lull does not wait behind a
    # full-budget prefill step.
    l1_hold_s: float = option(
        2.0,
        "multilevel: lower levels stay throttled this long after L1 traffic was seen",
        unit="seconds",
    )
    # While L1 traffic is present, lower levels prefill per step only as many tokens as keep a
    # step about this long, adapted from measured step times (Scheduler.observe_step), and never
    # fewer than their share.
    l1_step_time: float | None = option(
        None,
        "multilevel: while L1 traffic is present, size lower-level prefill so a step takes "
        "about this long (adapted from measured steps)",
        unit="seconds",
        none="their share of the budget",
    )
    # Overlap: schedule step N+1 (and process step N-1's outputs) while step N runs on a worker
    # thread; see engine/step_pipeline.py.
    async_scheduling: bool = option(True, "schedule step N+1 while step N runs")

    def __post_init__(self) -> None:
        self.scheduling_policy = SchedulingPolicy.parse(self.scheduling_policy, "scheduling_policy")
        self.queue_order = QueueOrder.parse(self.queue_order, "queue_order")
        self.preemption_mode = PreemptionMode.parse(self.preemption_mode, "preemption_mode")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}"
            )
        if self.l1_hold_s < 0:
            raise ValueError(f"l1_hold_s must be >= 0, got {self.l1_hold_s}")
        if self.l1_step_time is not None and self.l1_step_time <= 0:
            raise ValueError(f"l1_step_time must be > 0 seconds, got {self.l1_step_time}")
        if not 0.0 <= self.l2_min_share < 1.0:
            raise ValueError(f"l2_min_share must be in [0, 1), got {self.l2_min_share}")
        multilevel = self.scheduling_policy == SchedulingPolicy.MULTILEVEL
        if multilevel and self.l2_min_share > 0 and self.max_num_batched_tokens < 2:
            # L2's reserve must be at least one token beside L1's, or an L1 short of blocks
            # can preempt itself forever behind an L2 that never advances.
            raise ValueError(
                "the multilevel policy with l2_min_share > 0 needs max_num_batched_tokens >= 2"
            )
