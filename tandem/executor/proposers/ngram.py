"""Prompt lookup: the longest suffix of the sequence (prompt and output so far) that occurred
before, and the tokens that followed it then. It needs no model, and wins where the output
copies spans of the input (editing, summarising, code)."""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from tandem.core.outputs import SchedulerOutput
from tandem.executor.input_batch import CachedRequestState


class NgramProposer:
    def __init__(self, num_speculative_tokens: int, min_n: int = 1, max_n: int = 3) -> None:
        self.k = num_speculative_tokens
        self.min_n, self.max_n = min_n, max_n
        self.num_forwards = 0  # no model runs

    def propose_drafts(
        self,
        sched: SchedulerOutput,
        requests: dict[str, CachedRequestState],
        sampled: dict[str, list[int]],
    ) -> dict[str, list[int]]:
        """k tokens (or fewer, or none) for each request that sampled and takes drafts."""
        return {
            r: self.propose(requests[r].token_ids) for r in sampled if requests[r].params.drafts
        }

    def forget(self, req_ids: set[str]) -> None:
        """Nothing is kept per request."""

    def propose(self, token_ids: list[int]) -> list[int]:
        """Up to k tokens that followed an earlier occurrence of the longest matching suffix
        (max_n down to min_n tokens); [] when none occurred."""
        if len(token_ids) <= self.min_n:
            return []
        seq = np.asarray(token_ids, dtype=np.int64)
        for n in range(min(self.max_n, len(seq) - 1), self.min_n - 1, -1):
            # Windows that start before the suffix itself and leave at least one token after.
            windows = sliding_window_view(seq[:-1], n)
            hits = np.flatnonzero((windows == seq[-n:]).all(axis=1))
            if len(hits):
                # The most recent occurrence with k tokens after it (in a repeating tail the
                # latest one overlaps the end and leaves fewer), else the earliest.
                full = hits[hits + n + self.k <= len(seq)]
                start = int(full[-1] if len(full) else hits[0]) + n
                return seq[start : start + self.k].tolist()
        return []
