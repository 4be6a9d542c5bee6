"""Draft proposers for speculative decoding (the policy: core/spec_decode.py): what a request's
next tokens may be, cheaply, for the target to verify in one forward. One protocol, called once
per step after sampling, with three implementations: prompt lookup (`NgramProposer`), the
target's own precision variant (`SelfDraftProposer`) and another model (`DraftModelProposer`).
Every draft is one token per position with certainty (a lookup, or a greedy argmax), which
makes verification by sampling the target exact (executor/rejection_sampler.py)."""

from __future__ import annotations

from typing import Protocol

from tandem.config import SpeculativeConfig
from tandem.core.outputs import SchedulerOutput
from tandem.executor.input_batch import CachedRequestState, InputBuilder
from tandem.executor.kv_cache import KVCache
from tandem.executor.proposers.draft_model import DraftModelProposer, SelfDraftProposer
from tandem.executor.proposers.ngram import NgramProposer
from tandem.models.architectures.llama import LlamaForCausalLM


class Proposer(Protocol):
    num_forwards: (
        int  # model forwards run proposing (bench spec's cost per forward); 0 for a lookup
    )

    def propose_drafts(
        self,
        sched: SchedulerOutput,
        requests: dict[str, CachedRequestState],
        sampled: dict[str, list[int]],
    ) -> dict[str, list[int]]:
        """Drafts for the next step of requests that sampled in this one (`sampled`: their new
        tokens, already in `requests`' token_ids), after those tokens."""
        ...

    def forget(self, req_ids: set[str]) -> None:
        """Requests finished or preempted: drop what is kept of them."""
        ...


def build_proposer(
    spec: SpeculativeConfig | None,
    draft: LlamaForCausalLM | None,
    kv: KVCache,
    builder: InputBuilder,
) -> Proposer | None:
    """The proposer of `spec`; `draft` is its model (method "draft"), `builder` the target's."""
    if spec is None:
        return None
    if spec.method == "ngram":
        return NgramProposer(
            spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max
        )
    if kv.draft_kv_caches is None:  # a self-draft: the target's layout, KV and inputs
        return SelfDraftProposer(draft, kv.kv_caches, builder)
    return DraftModelProposer(
        draft,
        kv.draft_kv_caches,
        InputBuilder(
            builder.block_size,
            builder.device,
            builder.attention_backend,
            draft.cfg.head_dim,
            kv_dtype=builder.kv_dtype,
        ),
    )
