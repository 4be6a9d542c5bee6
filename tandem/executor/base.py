"""The one executor interface: SchedulerOutput in, sampled tokens (and timings) out."""
from __future__ import annotations

from typing import Protocol

from tandem.core.outputs import ModelRunnerOutput, SchedulerOutput


class Executor(Protocol):
    num_kv_blocks: int
    block_size: int

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput: ...
