"""The executor seam: the scheduler's decision for one step and what the step returns."""

from __future__ import annotations

from dataclasses import dataclass, field

from tandem.core.sampling_params import SamplingParams
from tandem.core.spec_decode import SpecDecodeStep


@dataclass(slots=True)
class NewRequestData:
    """A request the executor has not seen (or dropped at preemption): everything it needs."""

    req_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    eos_token_id: int | None = None
    precision: str | None = None  # the model variant (None: the default)


@dataclass(slots=True)
class CachedRequestData:
    """A request already in the executor's persistent batch: only what changed."""

    req_id: str
    new_block_ids: list[int]
    num_computed_tokens: int


@dataclass(slots=True)
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData] = field(default_factory=list)
    scheduled_cached_reqs: list[CachedRequestData] = field(default_factory=list)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    total_num_scheduled_tokens: int = 0
    # Requests the executor should forget: finished, aborted, or preempted since the last step.
    finished_req_ids: set[str] = field(default_factory=set)
    preempted_req_ids: set[str] = field(default_factory=set)
    # KV copies the executor makes before running the step, swap-outs first:
    # (device block, host block) and (host block, device block) pairs.
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)
    # Lower-level prompt tokens this step holds under the L1 throttle (multilevel): the
    # scheduler adapts the throttle from this step's measured time (Scheduler.observe_step).
    num_throttled_prefill_tokens: int = 0
    spec: SpecDecodeStep = field(default_factory=SpecDecodeStep)  # speculative decoding

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0


@dataclass(slots=True)
class ModelRunnerOutput:
    """Per scheduled request, the tokens sampled this step (empty for a partial prefill chunk;
    with drafts, the accepted ones plus the target's own next token)."""

    sampled_token_ids: dict[str, list[int]] = field(default_factory=dict)
    # Per request with logprobs asked: one list per sampled token of (token_id, logprob) pairs,
    # the sampled token first, then the top alternatives.
    logprobs: dict[str, list[list[tuple[int, float]]]] = field(default_factory=dict)
    # Per request with prompt logprobs asked, with its first sampled token: one list per prompt
    # token after the first, (token_id, logprob) then the top alternatives.
    prompt_logprobs: dict[str, list[list[tuple[int, float]]]] = field(default_factory=dict)
    execute_time: float = 0.0  # seconds the step took on the executor
    structured_output_time: float = 0.0  # of which filling and applying grammar bitmasks
    propose_time: float = 0.0  # of which proposing the next step's drafts (charged to that step)
    # Speculative decoding: drafts proposed for each request's next step, after this step's tokens.
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)


@dataclass(slots=True)
class EngineCoreOutput:
    """What the scheduler hands back to the engine per request after a step."""

    req_id: str
    new_token_ids: list[int]
    new_logprobs: list[list[tuple[int, float]]] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # Speculative decoding this step: drafts verified and accepted (request log figures)
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    prompt_logprobs: list[list[tuple[int, float]]] | None = None  # with the first token, if asked
