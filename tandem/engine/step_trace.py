"""`step_trace`: one JSON line per executed step, for diagnosing tail latency (which steps
were long, what they carried, and whether the L1 throttle shaped them) and fragmentation
(free KV while requests wait: the seat cap, the token budget, the host tier). `tandem bench
steps` summarises a trace; `tandem diagnose --steps` gives verdicts from it."""

from __future__ import annotations

import json
from typing import IO

from tandem.config.request_class import LEVELS
from tandem.core.outputs import SchedulerOutput
from tandem.core.scheduler import Scheduler
from tandem.engine.step_pipeline import ExecutedStep


def batch_context(sched: SchedulerOutput) -> tuple[int, int]:
    """(prefill attention pairs: per chunk, its tokens times the tokens it attends to at its
    end; decode context: per one-token step, the tokens it attends to)."""
    computed = {r.req_id: r.num_computed_tokens for r in sched.scheduled_new_reqs}
    computed.update((r.req_id, r.num_computed_tokens) for r in sched.scheduled_cached_reqs)
    attention = context = 0
    for req_id, n in sched.num_scheduled_tokens.items():
        if n == 1:
            context += computed[req_id] + 1
        else:
            attention += n * (computed[req_id] + n)
    return attention, context


class StepTrace:
    def __init__(self, path: str) -> None:
        self._file: IO[str] = open(
            path, "a", buffering=1
        )  # a line at a time: readable while serving

    def write(self, done: ExecutedStep, scheduler: Scheduler) -> None:
        sched, kv, cfg = done.sched, scheduler.kv, scheduler.config
        host = kv.host_tier
        attention, context = batch_context(sched)
        self._file.write(
            json.dumps(
                {
                    "start": done.start,
                    "seconds": done.end - done.start,
                    "tokens": sched.total_num_scheduled_tokens,
                    "seqs": len(sched.num_scheduled_tokens),
                    "prefill_tokens": sum(n for n in sched.num_scheduled_tokens.values() if n > 1),
                    "decodes": sum(1 for n in sched.num_scheduled_tokens.values() if n == 1),
                    # the cost model's batch shape (sim/cost_model.py): what `tandem bench
                    # fidelity` predicts each step's time from
                    "prefill_attention": attention,
                    "decode_context": context,
                    "throttled_prefill_tokens": sched.num_throttled_prefill_tokens,
                    "throttle": scheduler.lower_prefill_tokens,
                    "swap_out_blocks": len(sched.blocks_to_swap_out),
                    "swap_in_blocks": len(sched.blocks_to_swap_in),
                    "waiting": len(scheduler.waiting),
                    "running": len(scheduler.running),
                    "waiting_by_level": {f"L{lv}": scheduler.waiting.count(lv) for lv in LEVELS},
                    "kv_free_blocks": kv.num_free_blocks,
                    "kv_total_blocks": kv.num_blocks,
                    "host_free_blocks": host.num_free_host_blocks,
                    "host_total_blocks": host.num_host_blocks,
                    "swapped": host.num_swapped,
                    "preemptions": scheduler.num_preemptions,
                    "max_num_seqs": cfg.max_num_seqs,
                    "token_budget": cfg.max_num_batched_tokens,
                    # grammar masks, within `seconds`
                    "structured_output_seconds": done.result.structured_output_time,
                }
            )
            + "\n"
        )
