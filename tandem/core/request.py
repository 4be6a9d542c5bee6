"""A request as the scheduler sees it: token ids, progress, and why it ended."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from tandem.core.sampling_params import SamplingParams
from tandem.core.spec_decode import SpecState


def check_prompt_length(num_prompt_tokens: int, max_model_len: int) -> None:
    """The prompt rules, in one place (the front end's admission and the scheduler's guard):
    not empty, and room for at least one output token."""
    if num_prompt_tokens == 0:
        raise ValueError("the prompt is empty")
    if num_prompt_tokens >= max_model_len:
        raise ValueError(
            f"the prompt has {num_prompt_tokens} tokens; this engine serves at most "
            f"{max_model_len - 1} (max_model_len {max_model_len})"
        )


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_ABORTED = 5
    FINISHED_ERROR = 6

    @property
    def finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED


FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


@dataclass(slots=True, eq=False)
class Request:
    """One sequence. `num_computed_tokens` catches up with `all_token_ids`, so prefill,
    chunked prefill and decode are the same thing to the scheduler."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float = 0.0
    eos_token_id: int | None = None
    max_model_len: int = 1 << 30
    priority: int = 2  # 1 interactive, 2 standard, 3 background (as asked)
    level: int = 2  # the queue it is scheduled in (all 2 under the fcfs policy)
    # n > 1: siblings wait until this request's prompt is in the prefix cache, then share its
    # blocks.
    prefill_after: Request | None = None
    precision: str | None = None  # the model variant it runs on (None: the engine's only one)
    cache_salt: str | None = None  # prefix-cache namespace: KV of another variant is never reused
    all_token_ids: list[int] = field(default_factory=list)
    # Chained prefix-cache hashes of its first whole blocks, from its cache salt on: computed
    # once (KVCacheCoordinator.request_block_hashes); tokens are only appended, so they hold.
    block_hashes: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    # Tokens scheduled to be sampled whose ids are not known yet: at most the one of the step
    # in flight under async scheduling (the scheduler plans the next step as if it were there).
    num_output_placeholders: int = 0
    spec: SpecState = field(default_factory=SpecState)  # speculative decoding
    num_cached_tokens: int = -1  # prompt tokens served by the prefix cache at first schedule
    num_preemptions: int = 0
    swapped: bool = False  # preempted with its KV in the host pool (num_computed_tokens kept)
    status: RequestStatus = RequestStatus.WAITING
    stop_reason: int | str | None = None
    first_scheduled_time: float | None = None

    def __post_init__(self) -> None:
        if not self.all_token_ids:
            self.all_token_ids = list(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_tokens_with_placeholders(self) -> int:
        """What the KV must cover before the request samples again: known and in-flight tokens."""
        return len(self.all_token_ids) + self.num_output_placeholders

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[len(self.prompt_token_ids) :]

    @property
    def max_tokens(self) -> int:
        room = self.max_model_len - len(self.prompt_token_ids)
        mt = self.sampling_params.max_tokens
        return room if mt is None else min(mt, room)

    @property
    def finish_reason(self) -> str | None:
        return FINISH_REASONS.get(self.status)

    def check_stop(self) -> bool:
        """Stop on max_tokens, EOS or a stop token id. Stop strings are checked by the
        detokenizer."""
        params, tokens = self.sampling_params, self.all_token_ids
        last = tokens[-1]
        num_output = len(tokens) - len(self.prompt_token_ids)  # num_output_tokens, once: hot
        if num_output >= params.min_tokens:
            if (
                not params.ignore_eos and last == self.eos_token_id
            ) or last in params.stop_token_ids:
                self.status = RequestStatus.FINISHED_STOPPED
                self.stop_reason = last
                return True
        if num_output >= self.max_tokens:
            self.status = RequestStatus.FINISHED_LENGTH
            return True
        return False
