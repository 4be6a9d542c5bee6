"""Prompt logprobs (vLLM's `prompt_logprobs`, and `echo` with `logprobs`): the logprob of each
prompt token after the first, given the tokens before it, with the top alternatives, from the
logits of the prompt positions that prefill computes anyway. A request asking for them never
takes prefix-cache hits (every position must run), and its entries are collected over the
prefill's chunks and handed out with its first sampled token."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from tandem.executor.input_batch import CachedRequestState

Entry = list[tuple[int, float]]  # (the prompt token, its logprob), then the top alternatives
ROWS_PER_SLICE = 512  # logits rows at once: bounds the fp32 [rows, vocab] copy


class PromptLogprobs:
    def __init__(self) -> None:
        self.pending: dict[str, list[Entry]] = {}  # request -> entries of the prompt so far

    def forget(self, req_ids: set[str]) -> None:
        for req_id in req_ids:
            self.pending.pop(req_id, None)

    def take(self, req_id: str) -> list[Entry] | None:
        return self.pending.pop(req_id, None)

    def add_step(
        self,
        states: list[CachedRequestState],
        counts: np.ndarray,
        query_start_loc: np.ndarray,
        logits_of: Callable[[int, int], torch.Tensor],
    ) -> None:
        """The entries of the step's prompt positions. Position p predicts token p + 1, so the
        rows are those of positions up to the prompt's second-to-last; `logits_of(a, b)` gives
        the logits of rows a to b of the step's flattened batch."""
        for i, s in enumerate(states):
            k = s.params.prompt_logprobs
            if k is None or len(s.token_ids) > s.prompt_len:  # a recompute after output: sent
                continue
            first = s.num_computed_tokens
            last = min(first + int(counts[i]), s.prompt_len - 1)
            if first == 0:  # the prompt's start, or its recompute after a preemption
                self.pending[s.req_id] = []
            entries = self.pending.get(s.req_id)
            # A request resumed from swap goes on where it stopped (a request asking for prompt
            # logprobs takes no prefix hit, so its entries start at position 0).
            if entries is None or len(entries) != first or first >= last:
                continue
            start = int(query_start_loc[i])
            for a in range(first, last, ROWS_PER_SLICE):
                b = min(a + ROWS_PER_SLICE, last)
                lps = logits_of(start + a - first, start + b - first)
                lps = lps.to(torch.float32).log_softmax(dim=-1)
                entries += _entries(lps, s.token_ids[a + 1 : b + 1], k)


def _entries(lps: torch.Tensor, targets: list[int], k: int) -> list[Entry]:
    target = torch.tensor(targets, dtype=torch.long, device=lps.device)
    chosen = lps.gather(1, target.unsqueeze(1)).squeeze(1).tolist()
    if not k:
        return [[(t, lp)] for t, lp in zip(targets, chosen)]
    top_lps, top_ids = lps.topk(min(k, lps.shape[-1]), dim=-1)
    return [
        [(t, lp)] + list(zip(ids, tops))
        for t, lp, ids, tops in zip(targets, chosen, top_ids.tolist(), top_lps.tolist())
    ]
