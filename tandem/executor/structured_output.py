"""Per-request grammar matchers on the executor side: fill each constrained row's token bitmask,
apply the masks to the logits (batched, on their device) and advance the matchers with the
sampled tokens.

The matchers live here, beside the sampler, rather than beside the scheduler: with async
scheduling step N+1 is planned before step N's tokens are known, but the executor runs the
steps in order and samples step N's token before it builds step N+1's mask, so a matcher is
always advanced with the real token first. A request the executor drops (preemption by swap or
recompute) has its matcher rebuilt from its output tokens when it comes back.
"""

from __future__ import annotations

import logging
import time

import torch

from tandem.core.outputs import SchedulerOutput
from tandem.core.sampling_params import StructuredOutputsParams
from tandem.executor.grammar_compiler import GrammarCompiler

log = logging.getLogger(__name__)


class StructuredOutputMatchers:
    def __init__(self, compiler: GrammarCompiler) -> None:
        self.compiler = compiler
        self._matchers: dict[str, object] = {}  # req_id -> xgrammar.GrammarMatcher
        self.seconds = 0.0  # spent in apply(), summed (tandem bench structured)

    def update(self, sched: SchedulerOutput) -> None:
        """Forget requests finished or preempted; match the new constrained ones (rebuilt after
        a preemption)."""
        for req_id in sched.finished_req_ids | sched.preempted_req_ids:
            self.remove(req_id)
        for new in sched.scheduled_new_reqs:
            if new.sampling_params.structured_outputs is not None:
                self.add(new.req_id, new.sampling_params.structured_outputs, new.output_token_ids)

    def add(self, req_id: str, so: StructuredOutputsParams, output_token_ids: list[int]) -> None:
        """A matcher over the compiled grammar, advanced over the tokens already generated (a
        request resumed after preemption)."""
        import xgrammar as xgr

        matcher = xgr.GrammarMatcher(self.compiler.get(so))
        for token_id in output_token_ids:
            if not matcher.accept_token(token_id):
                log.warning("request %s: its output so far does not match its grammar", req_id)
                break
        self._matchers[req_id] = matcher

    def remove(self, req_id: str) -> None:
        self._matchers.pop(req_id, None)

    def apply(self, logits: torch.Tensor, req_ids: list[str]) -> float:
        """Set disallowed tokens to -inf in the rows of constrained requests (in place, with
        xgrammar's kernel for the logits' device). Returns the seconds it took (the step
        trace's masking cost)."""
        start = time.perf_counter()
        rows = [i for i, r in enumerate(req_ids) if r in self._matchers]
        if (
            not rows
        ):  # xgrammar is imported (seconds, once) only by a server that has a constrained request
            return 0.0
        import xgrammar as xgr

        # One int32 word per 32 tokens: bit j of word w allows token 32 * w + j.
        bitmask = torch.full(
            (len(req_ids), (self.compiler.vocab_size + 31) // 32), -1, dtype=torch.int32
        )
        eos = self.compiler.eos_token_id
        for i in rows:
            matcher = self._matchers[req_ids[i]]
            if not matcher.is_terminated():
                matcher.fill_next_token_bitmask(bitmask, i)
            elif eos is not None:  # accepted its stop token already (ignore_eos): only EOS again
                bitmask[i] = 0
                bit = 1 << (eos % 32)
                bitmask[i, eos // 32] = bit - (1 << 32) if bit >= 1 << 31 else bit
        xgr.apply_token_bitmask_inplace(
            logits, bitmask.to(logits.device, non_blocking=True), indices=rows
        )
        elapsed = time.perf_counter() - start
        self.seconds += elapsed
        return elapsed

    def accept(self, req_id: str, token_id: int) -> None:
        """Advance a constrained request's matcher with its sampled token."""
        matcher = self._matchers.get(req_id)
        if (
            matcher is not None
            and not matcher.is_terminated()
            and not matcher.accept_token(token_id)
        ):
            log.warning("request %s: sampled token %d rejected by its grammar", req_id, token_id)
