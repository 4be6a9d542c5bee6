"""The GPU's idle time between steps, from CUDA events: from the end of step N's work on the
device to the start of step N+1's model run (what the host's scheduling, input building and
output handling cost the GPU when they are not overlapped)."""
from __future__ import annotations

import torch


class StepGapTimer:
    def __init__(self) -> None:
        self.gap_seconds = 0.0
        self.num_gaps = 0
        self._last_end: torch.cuda.Event | None = None
        self._pending: tuple[torch.cuda.Event, torch.cuda.Event] | None = None

    def step_started(self) -> None:
        """After the step's inputs are enqueued, before the model runs."""
        start = torch.cuda.Event(enable_timing=True)
        start.record()
        self._pending = None if self._last_end is None else (self._last_end, start)

    def step_ended(self) -> None:
        """Waits for the step's work (its outputs are already on the host when it sampled)."""
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        end.synchronize()
        if self._pending is not None:
            self.gap_seconds += self._pending[0].elapsed_time(self._pending[1]) / 1e3
            self.num_gaps += 1
        self._last_end = end
