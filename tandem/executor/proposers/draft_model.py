"""A model as the draft: k tokens proposed greedily after each step that samples, by the target's
own precision variant (`self:int4`, `self:int8`, or the target's float weights, whose drafts the
target accepts all but always) or by another model that shares the target's tokenizer (an alias
or a path: a smaller model of the family, a copy truncated to its first layers).

A self-draft has the target's architecture, so it reads the target's paged KV for the context:
no draft prefill and no KV of its own. After a step samples a request's token at position P,
the draft runs k one-token forwards (batched over the drafting requests) at P .. P+k-1, writing
its KV into those positions' slots, which the scheduler allocated for this step past its own
positions (`SchedulerOutput.spec.num_lookahead_tokens`); the verify step that follows writes the
target's KV over them, and rejected positions are written again later, as for n-gram drafts.

Another model keeps KV of its own layers, in a cache of its own with the target's slots
(executor/kv_cache.py): one allocator and one block table serve both, so preemption, swap and
freeing stay the target's. Its KV is valid for the positions whose tokens it was fed: the known
ones, and the drafts it fed after them as far as the target accepted them. Before drafting, it
catches up in the same forward on what it has not seen (the prompt on the first proposal, a
prefix hit, the tokens of steps that did not draft, a P/D handoff); after a preemption it starts
again from position 0.
"""

from __future__ import annotations

import numpy as np
import torch

from tandem.core.outputs import SchedulerOutput
from tandem.executor.device import to_device
from tandem.executor.input_batch import CachedRequestState, InputBuilder, block_table
from tandem.executor.sampler import argmax
from tandem.models.architectures.llama import LlamaForCausalLM


class SelfDraftProposer:
    """k greedy forwards of the draft over the target's KV: the first over what the draft's KV
    lacks (the last token, for a self-draft), the rest one token each."""

    def __init__(
        self, model: LlamaForCausalLM, kv_caches: list[torch.Tensor], builder: InputBuilder
    ) -> None:
        self.model, self.kv_caches, self.builder = model, kv_caches, builder
        self.max_position = model.rotary.max_positions - 1
        self.num_forwards = 0  # draft forwards run (bench spec's cost per forward)

    def forget(self, req_ids: set[str]) -> None:
        """Nothing is kept per request: the target's KV is the draft's."""

    def _kv_len(self, req_id: str, token_ids: list[int]) -> int:
        """Positions of `token_ids` whose KV this draft holds: all but the last."""
        return len(token_ids) - 1

    @torch.inference_mode()
    def propose_drafts(
        self,
        sched: SchedulerOutput,
        requests: dict[str, CachedRequestState],
        sampled: dict[str, list[int]],
    ) -> dict[str, list[int]]:
        """For the requests that sampled and were given lookahead slots (the scheduler gives none
        to grammar-constrained ones): as many drafts as slots."""
        lookahead = sched.spec.num_lookahead_tokens
        states = [requests[r] for r in lookahead if r in sampled]
        if not states:
            return {}
        drafts = self._propose(
            [s.req_id for s in states],
            [s.token_ids for s in states],
            [s.block_ids for s in states],
            [lookahead[s.req_id] for s in states],
        )
        return {s.req_id: d for s, d in zip(states, drafts)}

    def _propose(
        self,
        req_ids: list[str],
        token_ids: list[list[int]],
        block_ids: list[list[int]],
        num_drafts: list[int],
    ) -> list[list[int]]:
        """Per request (its tokens, the last one just sampled and not yet in the KV; its block
        ids, lookahead included; drafts wanted): the draft's greedy continuation."""
        pos0 = np.array([len(t) - 1 for t in token_ids], dtype=np.int64)
        ks = np.minimum(np.array(num_drafts, dtype=np.int64), self.max_position - pos0 + 1)
        tables = block_table(block_ids)
        drafting = np.flatnonzero(ks > 0)
        # the first forward: what each request's KV lacks, its last token included
        queries = [token_ids[i][self._kv_len(req_ids[i], token_ids[i]) :] for i in drafting]
        rows, out = drafting, [[] for _ in token_ids]
        for step in range(int(ks.max(initial=0))):
            rows = rows[ks[rows] > step]
            if step:
                queries = [[out[i][-1]] for i in rows]
            starts = pos0[rows] + step - np.array([len(q) - 1 for q in queries], dtype=np.int64)
            for i, token in zip(rows.tolist(), self._forward(queries, starts, tables[rows])):
                out[i].append(token)
        self.num_forwards += int(ks.max(initial=0))
        return out

    def _forward(
        self, queries: list[list[int]], starts: np.ndarray, tables: np.ndarray
    ) -> list[int]:
        """Each row's query tokens from position starts[row]: write the draft's KV there, return
        the argmax token after each row's last."""
        qlens = np.array([len(q) for q in queries], dtype=np.int64)
        order = np.lexsort((starts + qlens, qlens > 1))  # one-token rows first, by context length
        ids = [token for i in order.tolist() for token in queries[i]]
        inputs = self.builder.build(ids, qlens[order], starts[order], tables[order])
        hidden = self.model(
            inputs.input_ids, inputs.positions, self.kv_caches, inputs.attn_metadata
        )
        last = to_device(inputs.query_start_loc[1:] - 1, self.builder.device)
        tokens = argmax(self.model.compute_logits(hidden[last])).tolist()
        result = [0] * len(order)
        for sorted_row, original in enumerate(order.tolist()):
            result[original] = tokens[sorted_row]
        return result


class DraftModelProposer(SelfDraftProposer):
    """Another model as the draft, with KV layers of its own (`kv_caches`, in the target's slots)
    and its own `builder` (its head_dim): it remembers, per request, what it has fed."""

    def __init__(
        self, model: LlamaForCausalLM, kv_caches: list[torch.Tensor], builder: InputBuilder
    ) -> None:
        super().__init__(model, kv_caches, builder)
        # per request, positions fed known tokens, and the drafts fed after them
        self._fed_tokens: dict[str, tuple[int, list[int]]] = {}

    def forget(self, req_ids: set[str]) -> None:
        """Requests finished or preempted: their blocks (and this KV) go back to the pool."""
        for req_id in req_ids:
            self._fed_tokens.pop(req_id, None)

    def _kv_len(self, req_id: str, token_ids: list[int]) -> int:
        """The known tokens fed, and the fed drafts the target accepted (all but the last token)."""
        known, tail = self._fed_tokens.get(req_id, (0, []))
        for token in token_ids[known : len(token_ids) - 1]:
            if not tail or tail[0] != token:
                break
            known, tail = known + 1, tail[1:]
        return min(known, len(token_ids) - 1)

    def _propose(
        self,
        req_ids: list[str],
        token_ids: list[list[int]],
        block_ids: list[list[int]],
        num_drafts: list[int],
    ) -> list[list[int]]:
        out = super()._propose(req_ids, token_ids, block_ids, num_drafts)
        for req_id, tokens, drafts in zip(req_ids, token_ids, out):
            if drafts:  # fed its tokens, and its drafts but the last
                self._fed_tokens[req_id] = (len(tokens), drafts[:-1])
        return out
