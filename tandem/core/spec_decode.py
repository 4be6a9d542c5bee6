"""Speculative decoding, the data half (no torch): the configuration, a request's and a step's
speculative state, how many drafts a request may verify, and the acceptance counters. What
speculation decides is core/spec_planner.py's.

A proposer (executor/proposers/) drafts up to k tokens after each step that sampled; the
scheduler schedules the request's next position plus those drafts as one chunk (every
position yields logits), and the verifier (executor/rejection_sampler.py) returns the accepted
drafts plus one token of the target's own. Rejected positions are rolled back by lowering
`num_computed_tokens`; drafts never enter `Request.all_token_ids`, so the prefix cache, which
indexes only those, never holds an unverified token.
"""
from __future__ import annotations

from dataclasses import dataclass, field

METHODS = ("ngram", "draft")
MAX_SPECULATIVE_TOKENS = 16


@dataclass(slots=True)
class SpeculativeConfig:
    """`LLM(speculative_config={...})`, `tandem serve --speculative-*`, or the mission's YAML
    `serving.speculative_decoding: {draft_model, verify_interval}` (verify_interval is k)."""

    method: str = "ngram"
    model: str | None = None  # the draft (method "draft"): self:int4 | self:int8 | self:bf16, alias or path
    num_speculative_tokens: int = 4  # k, drafts verified per step at most
    prompt_lookup_min: int = 1  # n-gram: shortest suffix matched
    prompt_lookup_max: int = 3  # n-gram: longest suffix matched (tried first)
    adaptive: bool = True  # k per step from batch size, acceptance and step costs (AdaptiveK); False: always k

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"unknown speculative method {self.method!r}; known: {', '.join(METHODS)}")
        k = self.num_speculative_tokens
        if not isinstance(k, int) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"num_speculative_tokens must be an integer in [1, {MAX_SPECULATIVE_TOKENS}], got {k!r}")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError("prompt_lookup_min and prompt_lookup_max must satisfy 1 <= min <= max, got "
                             f"{self.prompt_lookup_min} and {self.prompt_lookup_max}")
        if self.method == "draft":
            if not isinstance(self.model, str) or not self.model:
                raise ValueError("speculative method 'draft' needs a model: self:int4, self:int8, self:bf16 "
                                 "(the target's own variant) or another model's alias or path")
            if (self.prompt_lookup_min, self.prompt_lookup_max) != (1, 3):
                raise ValueError("prompt_lookup_min / prompt_lookup_max are options of method 'ngram'; "
                                 "method 'draft' takes none")
        elif self.model is not None:
            raise ValueError(f"speculative model {self.model!r} given, but method {self.method!r} takes no model")

    @property
    def self_draft(self) -> str | None:
        """The precision of a self-draft (`self:int4` -> "int4"), else None."""
        model = self.model or ""
        return model.removeprefix("self:") if self.method == "draft" and model.startswith("self:") else None

    @property
    def num_lookahead_tokens(self) -> int:
        """KV slots the scheduler allocates past a sampling step's positions: a draft model writes
        its KV for the k positions it proposes in the same step (n-gram drafting writes none)."""
        return self.num_speculative_tokens if self.method == "draft" else 0

    @classmethod
    def from_dict(cls, values: dict) -> SpeculativeConfig:
        names = set(cls.__dataclass_fields__)
        unknown = set(values) - names
        if unknown:
            raise ValueError(f"unknown speculative_config key(s): {', '.join(sorted(unknown))}; "
                             f"known: {', '.join(sorted(names))}")
        return cls(**values)

    @classmethod
    def from_yaml(cls, section: dict) -> dict:
        """The mission's `serving.speculative_decoding` -> speculative_config keys."""
        section = dict(section or {})
        out = {}
        if "draft_model" in section:
            draft = section.pop("draft_model")
            if draft not in (None, "ngram"):
                out["method"], out["model"] = "draft", draft
        if "verify_interval" in section:
            out["num_speculative_tokens"] = section.pop("verify_interval")
        out.update(section)  # any SpeculativeConfig key by name (method, ...)
        cls.from_dict(out)  # its errors now, naming the YAML's values
        return out


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
