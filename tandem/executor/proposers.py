"""Draft proposers for speculative decoding (see core/spec_decode.py): what a request's next
tokens may be, cheaply, for the target to verify in one forward.

`NgramProposer` is prompt lookup: the longest suffix of the sequence (prompt and output so far)
that occurred before, and the tokens that followed it then. It needs no model, and wins where
the output copies spans of the input (editing, summarising, code). Its draft is one token per
position with certainty, which makes verification by sampling the target exact
(executor/rejection_sampler.py).
"""
from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


class NgramProposer:
    def __init__(self, num_speculative_tokens: int, min_n: int = 1, max_n: int = 3) -> None:
        self.k = num_speculative_tokens
        self.min_n, self.max_n = min_n, max_n

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
                return seq[start:start + self.k].tolist()
        return []
