"""The one executor interface: SchedulerOutput in, sampled tokens (and timings) out."""
from __future__ import annotations

from typing import Protocol

from tandem.core.outputs import ModelRunnerOutput, SchedulerOutput


class Executor(Protocol):
    num_kv_blocks: int  # device KV pool, in blocks of block_size tokens
    num_host_blocks: int  # host tier for swapped-out requests
    block_size: int

    def preemption_costs(self) -> tuple[float, float]:
        """Seconds per token to swap KV out and back, and to recompute it."""
        ...

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Apply the swaps, run the step, return the sampled tokens."""
        ...
