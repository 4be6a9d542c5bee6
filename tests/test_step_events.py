"""StepGapTimer's accounting, with CUDA events stood in for by a hand-driven clock (the events
need a GPU)."""

from __future__ import annotations

import pytest
import torch

from tandem.executor.step_events import StepGapTimer

NOW = [0.0]  # seconds on the fake device clock


class _ClockEvent:
    def __init__(self, enable_timing: bool = False) -> None:
        self.t = None

    def record(self) -> None:
        self.t = NOW[0]

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, later: _ClockEvent) -> float:
        return (later.t - self.t) * 1e3  # ms, as CUDA events answer


def test_busy_and_gap_times(monkeypatch):
    monkeypatch.setattr(torch.cuda, "Event", _ClockEvent)
    timer = StepGapTimer()
    for busy, idle in [(0.020, 0.005), (0.030, 0.001), (0.010, 0.0)]:
        timer.step_started()
        NOW[0] += busy  # the step's work
        timer.step_ended()
        NOW[0] += idle  # the host between steps
    assert timer.num_steps == 3 and timer.num_gaps == 2  # no gap before the first step
    assert timer.busy_seconds == pytest.approx(0.060) and timer.gap_seconds == pytest.approx(0.006)
