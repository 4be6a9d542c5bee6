"""`step_trace`: one JSON line per executed step, for diagnosing tail latency (which steps
were long, what they carried, and whether the L1 throttle shaped them). `tandem bench steps`
summarises a trace."""
from __future__ import annotations

import json
from typing import IO

from tandem.core.scheduler import Scheduler
from tandem.engine.step_pipeline import ExecutedStep


class StepTrace:
    def __init__(self, path: str) -> None:
        self._file: IO[str] = open(path, "a", buffering=1)  # a line at a time: readable while serving

    def write(self, done: ExecutedStep, scheduler: Scheduler) -> None:
        sched = done.sched
        self._file.write(json.dumps({
            "start": done.start, "seconds": done.end - done.start,
            "tokens": sched.total_num_scheduled_tokens, "seqs": len(sched.num_scheduled_tokens),
            "prefill_tokens": sum(n for n in sched.num_scheduled_tokens.values() if n > 1),
            "throttled_prefill_tokens": sched.num_throttled_prefill_tokens,
            "throttle": scheduler.lower_prefill_tokens,
            "waiting": len(scheduler.waiting), "running": len(scheduler.running),
            "structured_output_seconds": done.result.structured_output_time,  # grammar masks, within `seconds`
        }) + "\n")
