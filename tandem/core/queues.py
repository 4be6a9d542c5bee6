"""Waiting requests by level (a request class's priority, config/request_class.py), the order
within a level, and the classifier that gives a request its level when the client did not."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator

from tandem.config.request_class import LEVELS, PRIORITIES, STANDARD
from tandem.config.scheduler import QueueOrder
from tandem.core.request import Request, RequestStatus


def classify(
    prompt_tokens: int, max_tokens: int | None, l1_max_prompt: int, l1_max_output: int
) -> int:
    """Short prompt and short answer: L1 (interactive); anything else L2. L3 only on request."""
    if prompt_tokens <= l1_max_prompt and max_tokens is not None and max_tokens <= l1_max_output:
        return PRIORITIES["interactive"]
    return STANDARD


class WaitingQueues:
    """One deque per level. A preempted request goes back to the front of its level, so it
    resumes ahead of newer requests of that level. Order within a level: FCFS, or shortest
    prompt first with aging (`spf`: a request gains `aging` tokens of priority per second
    waited, so long prompts are not starved)."""

    def __init__(self, order: QueueOrder, clock: Callable[[], float], aging: float = 100.0) -> None:
        self.order, self.clock, self.aging = order, clock, aging
        self.queues: dict[int, deque[Request]] = {level: deque() for level in LEVELS}

    def __len__(self) -> int:
        return sum(len(q) for q in self.queues.values())

    def __bool__(self) -> bool:
        return any(self.queues.values())

    def __iter__(self) -> Iterator[Request]:
        for level in LEVELS:
            yield from self.queues[level]

    def count(self, level: int) -> int:
        return len(self.queues[level])

    def append(self, req: Request) -> None:
        self.queues[req.level].append(req)

    def push_front(self, req: Request) -> None:
        self.queues[req.level].appendleft(req)

    def remove(self, req: Request) -> None:
        q = self.queues[req.level]
        if q and q[0] is req:
            q.popleft()
        else:
            q.remove(req)

    def in_order(self, level: int) -> list[Request]:
        """The level's requests in the order they should be admitted."""
        q = self.queues[level]
        if self.order == QueueOrder.FCFS or len(q) < 2:
            return list(q)
        resumed = [r for r in q if r.status == RequestStatus.PREEMPTED]
        now = self.clock()
        fresh = sorted(
            (r for r in q if r.status != RequestStatus.PREEMPTED),
            key=lambda r: r.num_prompt_tokens - self.aging * (now - r.arrival_time),
        )
        return resumed + fresh
