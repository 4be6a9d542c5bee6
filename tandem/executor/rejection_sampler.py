"""Verification of speculative drafts: the target's token at every drafted position, and the
longest accepted prefix (Leviathan et al. 2023; Chen et al. 2023).

A request with k drafts d_1..d_k contributes k+1 logits rows: row j is the target's
distribution after the drafts d_1..d_j. Each row is sampled by the ordinary Sampler (greedy,
or temperature / top-k / top-p / min-p, with the penalties and min_tokens of the output as it
would be after d_1..d_j, and the request's own generator). Draft d_{j+1} is accepted when it
equals row j's token; the first mismatch is replaced by row j's token, and if all k are
accepted row k's token is a bonus.

For a one-hot draft (n-gram) this is rejection sampling exactly: accepting d with probability
min(1, p(d) / q(d)) = p(d) and otherwise drawing from (p - q)+ renormalised (p without d) is
the same law as drawing t ~ p and accepting iff t == d. So every emitted token follows the
target's distribution given the tokens before it, and greedy output equals no speculation.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tandem.core.sampling_params import SamplingParams
from tandem.executor.sampler import LogitBias, Sampler, SamplingMetadata, SamplingRow


@dataclass(slots=True)
class VerifyRow:
    """One request that samples this step, with the drafts (possibly none) it verifies."""

    params: SamplingParams
    prompt_token_ids: list[int]  # may be [] when no repetition penalty reads it
    output_token_ids: list[int]
    generator: torch.Generator | None
    eos_token_id: int | None
    logit_bias: LogitBias | None
    drafts: list[int]


def logits_indices(ends: list[int], num_drafts: list[int]) -> list[int]:
    """Flattened-batch positions whose logits are needed: the last 1 + k of each request
    (`ends` are the exclusive ends of the requests' spans)."""
    return [i for end, k in zip(ends, num_drafts) for i in range(end - 1 - k, end)]


def rewind(generator: torch.Generator, state: torch.Tensor, draws: int, vocab_size: int) -> None:
    """Leave a seeded request's generator as `draws` sampled rows from `state` leave it (each
    row draws vocab_size exponentials, as Sampler does), dropping the rejected positions' draws:
    its later tokens are then those of a run without speculation."""
    generator.set_state(state)
    noise = torch.empty(vocab_size, dtype=torch.float32, device=generator.device)
    for _ in range(draws):
        noise.exponential_(generator=generator)


class RejectionSampler:
    def __init__(self, sampler: Sampler) -> None:
        self.sampler = sampler

    def __call__(
        self, logits: torch.Tensor, rows: list[VerifyRow], device: torch.device
    ) -> list[tuple[list[int], list[list[tuple[int, float]]] | None]]:
        """Per request: the tokens it emits (accepted drafts + one of the target's) and their
        logprobs (None unless asked). `logits` holds 1 + len(drafts) rows per request, in order."""
        sampling_rows = []
        for r in rows:
            for j in range(len(r.drafts) + 1):
                output = r.output_token_ids + r.drafts[:j] if j else r.output_token_ids
                sampling_rows.append(
                    SamplingRow(
                        r.params,
                        r.prompt_token_ids,
                        output,
                        r.generator,
                        r.eos_token_id,
                        r.logit_bias,
                    )
                )
        streams = {
            i: r.generator.get_state()
            for i, r in enumerate(rows)
            if r.drafts and r.generator is not None and not r.params.greedy
        }
        result = self.sampler(
            logits, SamplingMetadata.build(sampling_rows, logits.shape[-1], device)
        )
        out, start = [], 0
        for i, r in enumerate(rows):
            targets = result.sampled_token_ids[start : start + len(r.drafts) + 1]
            accepted = 0
            while accepted < len(r.drafts) and r.drafts[accepted] == targets[accepted]:
                accepted += 1
            if i in streams and accepted < len(r.drafts):
                rewind(r.generator, streams[i], accepted + 1, logits.shape[-1])
            lps = None
            if result.logprobs is not None and r.params.logprobs is not None:
                lps = result.logprobs[start : start + accepted + 1]
            out.append((targets[: accepted + 1], lps))
            start += len(r.drafts) + 1
        return out
