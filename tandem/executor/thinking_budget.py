"""Reasoning token budgets on the executor side (vLLM's thinking_token_budget, llama.cpp's
--reasoning-budget): count a request's tokens inside its <think> block and, once the budget is
spent, force the block's end token by token (every other logit -inf), so that the model goes on
to its answer.

Like the grammar matchers, the state is advanced with each sampled token before the next mask
is built, and rebuilt from the output tokens when a preempted request comes back.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tandem.core.outputs import SchedulerOutput
from tandem.core.sampling_params import ThinkingBudget


@dataclass(slots=True)
class _Count:
    budget: ThinkingBudget
    inside: bool  # past the block's start
    spent: int = 0  # tokens inside the block
    forced: int = 0  # end tokens forced so far
    done: bool = False  # the block has ended, by itself or forced
    tail: list[int] = field(default_factory=list)  # the last tokens, to see a marker

    def next_forced(self) -> int | None:
        """The end token this request must sample next, or None while it samples freely."""
        if self.done or not self.inside or self.spent < self.budget.tokens:
            return None
        return self.budget.end[self.forced]

    def accept(self, token_id: int) -> None:
        if self.done:
            return
        if self.next_forced() is not None:
            self.forced += 1
            self.done = self.forced == len(self.budget.end)
            return
        self.tail = (self.tail + [token_id])[-max(len(self.budget.start), len(self.budget.end)) :]
        if not self.inside:
            self.inside = self.tail[-len(self.budget.start) :] == list(self.budget.start)
            self.tail.clear()
        elif self.tail[-len(self.budget.end) :] == list(self.budget.end):
            self.done = True
        else:
            self.spent += 1


class ThinkingBudgets:
    def __init__(self) -> None:
        self._counts: dict[str, _Count] = {}  # req_id -> its count

    @property
    def active(self) -> bool:
        """Whether any request in the batch has a budget (else a step skips this)."""
        return bool(self._counts)

    def update(self, sched: SchedulerOutput) -> None:
        """Forget requests finished or preempted; count the new budgeted ones (recounted over
        their output after a preemption)."""
        for req_id in sched.finished_req_ids | sched.preempted_req_ids:
            self._counts.pop(req_id, None)
        for new in sched.scheduled_new_reqs:
            budget = new.sampling_params.thinking_budget
            if budget is not None:
                count = _Count(budget, inside=not budget.start)
                for token_id in new.output_token_ids:
                    count.accept(token_id)
                self._counts[new.req_id] = count

    def apply(self, logits: torch.Tensor, req_ids: list[str]) -> None:
        """Leave only the forced token possible in the rows of requests out of budget."""
        for i, req_id in enumerate(req_ids):
            count = self._counts.get(req_id)
            token_id = count.next_forced() if count is not None else None
            if token_id is not None:
                logits[i] = float("-inf")
                logits[i, token_id] = 0.0

    def accept(self, req_id: str, token_id: int) -> None:
        count = self._counts.get(req_id)
        if count is not None:
            count.accept(token_id)
