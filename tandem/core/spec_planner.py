"""SpecPlanner: what speculative decoding decides on the core side (no torch).

It owns the policy (AdaptiveK, or a fixed k), the k chosen one step ahead, the lookahead slots
of a draft model, the rollback after a verify step and the acceptance counters. The scheduler
calls it at named points of a step: `plan` as a step is planned, `num_drafts` and `lookahead`
while a request is fitted into it, `schedule` or `admit` once it is, and `after_step` when the
step's tokens are known. The engine asks `will_draft` before planning a step and reports each
step's cost to `observe_step`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from tandem.config.speculative import MAX_SPECULATIVE_TOKENS, SpeculativeConfig
from tandem.core.adaptive_k import AdaptiveK
from tandem.core.outputs import ModelRunnerOutput, SchedulerOutput
from tandem.core.spec_decode import SpecDecodeStats, num_drafts

if TYPE_CHECKING:
    from tandem.core.request import Request


@dataclass(frozen=True, slots=True)
class Speculation:
    """What the scheduler is told of speculative decoding: drafts verified per request and step
    at most (0: none asked for, those proposed verified as they come), whether AdaptiveK picks
    fewer (down to 0) from measured acceptance and step costs, and the KV slots past a sampling
    step a draft model writes its proposals' KV into (0: n-gram, or no speculation)."""

    num_speculative_tokens: int = 0
    adaptive_speculation: bool = True
    num_lookahead_tokens: int = 0

    @classmethod
    def of(cls, config: SpeculativeConfig | None) -> Speculation:
        if config is None:
            return cls()
        return cls(config.num_speculative_tokens, config.adaptive, config.num_lookahead_tokens)


class SpecPlanner:
    def __init__(self, config: Speculation) -> None:
        self.k_max = config.num_speculative_tokens  # 0: no speculation
        self.max_lookahead = config.num_lookahead_tokens
        self.stats = SpecDecodeStats()
        self.policy = AdaptiveK(self.k_max) if self.k_max and config.adaptive_speculation else None
        # Drafts per request in the coming step: the policy's choice, made when the step before
        # was planned (so that step's executor proposes only when they are wanted), else up to
        # what is proposed.
        self._next_drafts = 0 if self.policy else self.k_max or MAX_SPECULATIVE_TOKENS
        self._max_drafts = self._next_drafts

    def will_draft(self) -> bool:
        """Whether the coming step drafts. The engine asks before planning it, so under async
        scheduling it can first hand back the step in flight (a request drafts only once its
        last token is known); a step that does not draft overlaps as without speculation."""
        return self.k_max > 0 and self._next_drafts > 0

    def plan(self, out: SchedulerOutput, running: list[Request]) -> None:
        """A step is being planned: its k was chosen a step before; choose the next step's now,
        so that this step's executor proposes only drafts that will be verified."""
        self._max_drafts = self._next_drafts
        out.spec.drafting = self.will_draft()
        if self.policy is not None:  # requests that opted out (or are constrained) never draft
            drafters = any(r.sampling_params.drafts for r in running)
            self._next_drafts = self.policy.choose(len(running)) if drafters else 0
        out.spec.propose = self._next_drafts > 0

    def num_drafts(self, req: Request, pending: int, budget_left: int) -> int:
        """Drafts `req` verifies this step: only on a decode whose last token is known (none in
        flight), and no more than this step's k (a draft model's lookahead was sized by it)."""
        drafts = req.spec.draft_token_ids
        if not drafts or pending != 1 or req.num_output_placeholders:
            return 0
        return num_drafts(
            min(len(drafts), self._max_drafts),
            budget_left,
            req.max_tokens - req.num_output_tokens,
        )

    def lookahead(self, req: Request, num_scheduled_end: int) -> int:
        """KV slots past this step's positions for the drafts a draft model proposes in it: only
        when the step samples the request's token (its scheduled positions end at
        `num_scheduled_end`), the request speculates, and it may still emit more than one token
        after this step (a verify step of d drafts emits up to d + 1)."""
        if (
            not self.max_lookahead
            or not req.sampling_params.drafts
            or num_scheduled_end < req.num_tokens_with_placeholders
        ):
            return 0
        rest = req.max_tokens - req.num_output_tokens - req.num_output_placeholders - 1
        # the drafts proposed in this step are verified in the next: its k, chosen in plan()
        return max(0, min(self.max_lookahead, self._next_drafts, rest - 1))

    def schedule(self, req: Request, k: int, lookahead: int, out: SchedulerOutput) -> None:
        """Running `req` is in the step with `k` drafts and `lookahead` slots. Its drafts are
        consumed: the next proposal follows this step's tokens."""
        if k:
            out.spec.draft_token_ids[req.request_id] = req.spec.draft_token_ids[:k]
        if lookahead:
            self.admit(req, lookahead, out)
        if req.spec.draft_token_ids:  # a new list only when there were drafts: a step's hot path
            req.spec.draft_token_ids = []

    def admit(self, req: Request, lookahead: int, out: SchedulerOutput) -> None:
        """Waiting `req` is admitted into the step with `lookahead` slots (it verifies nothing)."""
        if lookahead:
            out.spec.num_lookahead_tokens[req.request_id] = lookahead

    def after_step(
        self, req: Request, sched: SchedulerOutput, result: ModelRunnerOutput, num_sampled: int
    ) -> tuple[int, int]:
        """The step's `num_sampled` tokens were appended to `req`: roll back its rejected
        drafts, count them, keep the drafts proposed for its next step. Returns (drafts
        verified, accepted).

        The rejected drafts' KV slots stay allocated and are written again. The request sat out
        any step planned since (pending <= 0), and a recompute preemption meanwhile left 0
        computed tokens, so only a rejected tail is dropped here."""
        verified = sched.spec.draft_token_ids
        k = len(verified.get(req.request_id, ())) if verified else 0
        accepted = num_sampled - 1 if k and num_sampled else 0
        if k and num_sampled:
            req.num_computed_tokens = min(req.num_computed_tokens, req.num_tokens - 1)
            req.spec.num_draft_tokens += k
            req.spec.num_accepted_tokens += accepted
            self.stats.observe(k, accepted)
            if self.policy is not None:
                self.policy.observe_verify(k, accepted)
        proposed = result.spec_token_ids.get(req.request_id) if result.spec_token_ids else None
        if (proposed or req.spec.draft_token_ids) and not req.status.finished:
            req.spec.draft_token_ids = proposed or []
        return k, accepted

    def trace_policy(self, callback) -> bool:
        """Record the policy's choices and the steps it saw with `callback` (one dict each); False
        when no adaptive policy runs."""
        if self.policy is None:
            return False
        self.policy.trace = callback
        return True

    def observe_step(
        self, out: SchedulerOutput, seconds: float, proposal_seconds: float = 0.0
    ) -> None:
        """A step that ran took `seconds` as throughput sees it (the executor's time and its
        idle wait before the step), `proposal_seconds` of them proposing the next step's drafts."""
        if self.policy is None:
            return
        drafts = out.spec.draft_token_ids
        pure_decode = not out.scheduled_new_reqs and all(
            n == 1 + len(drafts.get(rid, ())) for rid, n in out.num_scheduled_tokens.items()
        )
        self.policy.observe_step(
            out.total_num_scheduled_tokens,
            seconds,
            len(out.num_scheduled_tokens) if pure_decode else 0,
            out.spec.drafting,
            tuple(map(len, drafts.values())),
            proposal_seconds,
        )
