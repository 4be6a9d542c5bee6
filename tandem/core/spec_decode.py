"""Speculative decoding, the data half (no torch): a request's and a step's speculative state,
how many drafts a request may verify, and the acceptance counters. What speculation decides is
core/spec_planner.py's; its configuration, config/speculative.py.

A proposer (executor/proposers/) drafts up to k tokens after each step that sampled; the
scheduler schedules the request's next position plus those drafts as one chunk (every
position yields logits), and the verifier (executor/rejection_sampler.py) returns the accepted
drafts plus one token of the target's own. Rejected positions are rolled back by lowering
`num_computed_tokens`; drafts never enter `Request.all_token_ids`, so the prefix cache, which
indexes only those, never holds an unverified token.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class SpecState:
    """A request's speculation: the drafts proposed after its last token, not verified (never in
    all_token_ids), and its totals of drafts verified and accepted."""

    draft_token_ids: list[int] = field(default_factory=list)
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0


@dataclass(slots=True)
class SpecDecodeStep:
    """Speculation in one scheduled step, for the executor."""

    # The drafts each request verifies this step, scheduled after its next position
    # (num_scheduled_tokens counts them).
    draft_token_ids: dict[str, list[int]] = field(default_factory=dict)
    # A draft model's proposals in this step, after each request's sampled token: KV slots
    # allocated past the step's own positions.
    num_lookahead_tokens: dict[str, int] = field(default_factory=dict)
    # Planned to draft: under async scheduling the step before was handed back first.
    drafting: bool = False
    # Propose drafts after this step: only when the next step may verify them, so a step with
    # speculation off by choice does no more.
    propose: bool = False


def num_drafts(num_proposed: int, budget_left: int, tokens_left: int) -> int:
    """Drafts a decoding request verifies this step: what was proposed, within the step's token
    budget (its own next position needs one) and `tokens_left`, the tokens it may still emit
    (a verify step emits up to drafts + 1)."""
    return max(0, min(num_proposed, budget_left - 1, tokens_left - 1))


@dataclass(slots=True)
class SpecDecodeStats:
    """Counters since start: verify steps (a request with drafts in a step), drafts verified,
    drafts accepted, and accepted drafts by position (0 = first draft)."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)

    def observe(self, num_draft_tokens: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        if len(self.accepted_per_pos) < num_draft_tokens:
            self.accepted_per_pos.extend([0] * (num_draft_tokens - len(self.accepted_per_pos)))
        for pos in range(num_accepted):
            self.accepted_per_pos[pos] += 1

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per verify step: accepted drafts plus the target's own token."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0
