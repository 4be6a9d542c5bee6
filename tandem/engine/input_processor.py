"""The front end's admission: tokenise and apply the prompt rules (the one place for them, each
with one message), choose the precision variant and the queue class, and fan n > 1 out into
per-sequence sampling params. What leaves here is an EngineCoreRequest the core only queues."""

from __future__ import annotations

import dataclasses
import time

from tandem.config import SchedulerConfig
from tandem.core.queues import classify
from tandem.core.request import check_prompt_length
from tandem.core.sampling_params import SamplingParams
from tandem.engine.core_messages import EngineCoreRequest
from tandem.engine.precision import PrecisionRouter

PromptType = str | list[int]


class InputProcessor:
    def __init__(
        self,
        config: SchedulerConfig,
        tokenizer,
        vocab_size: int,
        max_model_len: int,
        precisions: PrecisionRouter,
    ) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.precisions = precisions

    def tokenize(self, prompt: PromptType) -> list[int]:
        """Token ids of a prompt (text, or ids checked against the vocabulary)."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer: pass prompts as token ids")
            return self.tokenizer.encode(prompt)
        if not isinstance(prompt, (list, tuple)) or not all(isinstance(t, int) for t in prompt):
            raise ValueError("a prompt is a string or a list of token ids")
        self.check_token_ids(prompt)
        return list(prompt)

    def check_token_ids(self, token_ids: list[int]) -> None:
        bad = [t for t in token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})")

    def check_prompt(self, token_ids: list[int]) -> None:
        check_prompt_length(len(token_ids), self.max_model_len)

    def process(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams,
        arrival_time: float | None = None,
        priority: int | None = None,
        precision: str | None = None,
    ) -> EngineCoreRequest:
        """Raises ValueError (a 400 at the server) on bad input. `priority` 1/2/3; None:
        classified by length. `precision`: the variant asked for; None: the class's, else the
        default."""
        token_ids = self.tokenize(prompt)
        self.check_prompt(token_ids)
        if params.logit_bias:
            self.check_token_ids(list(params.logit_bias))
        variant = self.precisions.choose(precision, priority)
        if priority is None:
            priority = classify(
                len(token_ids),
                params.max_tokens,
                self.config.l1_max_prompt_tokens,
                self.config.l1_max_tokens,
            )
        per_seq = [params] if params.n == 1 else [_child_params(params, i) for i in range(params.n)]
        return EngineCoreRequest(
            request_id,
            token_ids,
            per_seq,
            time.monotonic() if arrival_time is None else arrival_time,
            priority,
            variant,
            cache_salt(self.precisions.cache_salt(variant), params),
        )


def cache_salt(variant_salt: str | None, params: SamplingParams) -> str | None:
    """The prefix cache's namespace: the variant's, and the adapter's (KV computed under one
    adapter is never reused under another, nor under one reloaded with the same name)."""
    lora = params.lora_request
    if lora is None:
        return variant_salt
    return f"{variant_salt or ''}/lora:{lora.lora_int_id}"


def _child_params(params: SamplingParams, i: int) -> SamplingParams:
    """Sequence i of n: its own seed. Only the first asks for prompt logprobs: the prompt's are
    the same for all, and a request asking for them skips the prefix cache."""
    return dataclasses.replace(
        params,
        n=1,
        seed=None if params.seed is None else params.seed + i,
        prompt_logprobs=params.prompt_logprobs if i == 0 else None,
    )
