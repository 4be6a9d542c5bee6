"""Hands scheduled steps to the executor: inline (one step at a time), or, with async
scheduling, on a worker thread one step ahead of the engine thread.

With overlap the engine thread schedules step N+1 while step N runs, waits for step N,
tops step N+1 up with the requests that arrived meanwhile (a few admissions: the executor
idles for that long only), submits it, and turns step N's tokens into outputs while step N+1
runs. Step N+1 is planned before step N's tokens
are known: the scheduler counts each of them as a placeholder (core/request.py), and the
model runner reads the real token from its own state when it builds step N+1's inputs. The
executor runs steps strictly in order, so a block that the engine thread frees or caches
while a step runs is only reused or read by a later step.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any, TypeVar

from tandem.core.outputs import ModelRunnerOutput, SchedulerOutput

T = TypeVar("T")


@dataclass(slots=True)
class ExecutedStep:
    sched: SchedulerOutput
    result: ModelRunnerOutput
    start: float  # perf_counter when the executor began the step, and when it returned
    end: float


class StepPipeline:
    def __init__(
        self, execute: Callable[[SchedulerOutput], ModelRunnerOutput], overlap: bool
    ) -> None:
        self._execute = execute
        self.overlap = overlap
        self._worker = (
            ThreadPoolExecutor(1, thread_name_prefix="tandem-execute") if overlap else None
        )
        self._in_flight: deque[Future] = deque()

    def __len__(self) -> int:
        return len(self._in_flight)

    def in_flight(self) -> list[Future]:
        """The steps submitted and not handed back. Once they are done, no running step can
        still write a block freed before now: KV transfer waits on them before writing."""
        return list(self._in_flight)

    def call(self, fn: Callable[..., T], *args: Any) -> T:
        """Run fn on the thread that runs the steps (and wait for it)."""
        return fn(*args) if self._worker is None else self._worker.submit(fn, *args).result()

    def submit(self, sched: SchedulerOutput) -> None:
        """Queue a step; without overlap it runs now (and its errors raise here)."""
        if self._worker is not None:
            self._in_flight.append(self._worker.submit(self._run, sched))
            # Let the worker take the GIL and start the step now: the engine thread goes on
            # with Python work (outputs of the step before) that would hold the worker back.
            time.sleep(0)
            return
        done: Future = Future()
        done.set_result(self._run(sched))
        self._in_flight.append(done)

    def pop(self) -> ExecutedStep:
        """The oldest step, once it has run. If it failed, the steps behind it (planned on its
        tokens) are dropped too, after they ran, and the error is raised."""
        future = self._in_flight.popleft()
        try:
            return future.result()
        except BaseException:
            wait(self._in_flight)
            self._in_flight.clear()
            raise

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown(wait=True)

    def _run(self, sched: SchedulerOutput) -> ExecutedStep:
        start = time.perf_counter()
        result = self._execute(sched)
        return ExecutedStep(sched, result, start, time.perf_counter())
