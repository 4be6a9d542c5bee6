"""The GPU's time per step, from CUDA events: busy, from the start of a step's model run to the
end of its work, and idle between steps, from the end of step N's work to the start of step
N+1's model run (what the host's scheduling, input building and output handling cost the GPU
when they are not overlapped)."""

from __future__ import annotations

import torch


class StepGapTimer:
    def __init__(self) -> None:
        self.gap_seconds = 0.0
        self.num_gaps = 0
        self.busy_seconds = 0.0
        self.num_steps = 0
        self._start: torch.cuda.Event | None = None
        self._last_end: torch.cuda.Event | None = None

    def step_started(self) -> None:
        """After the step's inputs are enqueued, before the model runs."""
        self._start = torch.cuda.Event(enable_timing=True)
        self._start.record()

    def step_ended(self) -> None:
        """Waits for the step's work (its outputs are already on the host when it sampled)."""
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        end.synchronize()
        if self._last_end is not None:
            self.gap_seconds += self._last_end.elapsed_time(self._start) / 1e3
            self.num_gaps += 1
        self.busy_seconds += self._start.elapsed_time(end) / 1e3
        self.num_steps += 1
        self._last_end = end
