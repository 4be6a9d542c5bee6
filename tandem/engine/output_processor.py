"""Turns per-step token ids into what callers see: text deltas, stop strings, n > 1
grouped under one request, and per-request timings."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from tandem.core.outputs import EngineCoreOutput
from tandem.engine.core_messages import ScheduledEvent
from tandem.engine.detokenizer import IncrementalDetokenizer


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # One entry per token: [(sampled_id, logprob), (alt_id, logprob), ...]
    logprobs: list[list[tuple[int, float]]] | None = None
    delta_text: str = ""  # new since the previous RequestOutput of this request
    delta_token_ids: list[int] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    num_spec_steps: int = 0  # speculative decoding: verify steps, drafts verified, accepted
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    metrics: RequestMetrics
    finished: bool = False
    # Asked for: one entry per prompt token after the first, as CompletionOutput.logprobs
    prompt_logprobs: list[list[tuple[int, float]]] | None = None
    priority: int = 2
    precision: str | None = None  # the model variant that served it


@dataclass(slots=True, eq=False)
class _Child:
    output: CompletionOutput
    detokenizer: IncrementalDetokenizer
    parent: RequestOutput
    include_stop: bool  # keep a terminating EOS / stop token's text


class OutputProcessor:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.children: dict[str, _Child] = {}  # child request id -> state
        self.parents: dict[str, list[str]] = {}  # request id -> its child ids

    def add(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        children: list[tuple[str, object]],
        arrival_time: float,
        priority: int = 2,
        precision: str | None = None,
    ) -> None:
        parent = RequestOutput(
            request_id,
            prompt,
            prompt_token_ids,
            [],
            RequestMetrics(arrival_time),
            priority=priority,
            precision=precision,
        )
        for index, (child_id, params) in enumerate(children):
            out = CompletionOutput(index, logprobs=[] if params.logprobs is not None else None)
            parent.outputs.append(out)
            detok = IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params)
            self.children[child_id] = _Child(out, detok, parent, params.include_stop_str_in_output)
        self.parents[request_id] = [cid for cid, _ in children]

    def child_ids(self, request_id: str) -> list[str]:
        return self.parents.get(request_id, [])

    def has_unfinished(self) -> bool:
        return bool(self.parents)

    def abort(self, child_ids: list[str], reason: str = "abort") -> list[RequestOutput]:
        touched = {}
        for cid in child_ids:
            child = self.children.pop(cid, None)
            if child is not None and not child.output.finished:
                child.output.finish_reason = reason
                touched[id(child.parent)] = child.parent
        return [self._finish_if_done(p) for p in touched.values()]

    def on_scheduled(self, events: list[ScheduledEvent]) -> None:
        """First admissions of requests (and re-admissions after preemption)."""
        for ev in events:
            child = self.children.get(ev.request_id)
            if child is None:
                continue
            m = child.parent.metrics
            if m.first_scheduled_time is None:
                m.first_scheduled_time, m.num_cached_tokens = ev.time, ev.num_cached_tokens
            m.num_preemptions = max(m.num_preemptions, ev.num_preemptions)

    def process(
        self, core_outputs: list[EngineCoreOutput], now: float
    ) -> tuple[list[RequestOutput], list[str]]:
        """Returns the updated requests and the child ids a stop string finished (the core
        must free them). `now`: when the core had these tokens (time.monotonic())."""
        touched: dict[int, RequestOutput] = {}
        stopped: list[str] = []
        for co in core_outputs:
            child = self.children.get(co.req_id)
            if child is None:
                continue
            out, parent = child.output, child.parent
            if id(parent) not in touched:
                for o in parent.outputs:
                    o.delta_text, o.delta_token_ids = "", []
                touched[id(parent)] = parent
            m = parent.metrics
            if m.first_token_time is None:
                m.first_token_time = now
            m.last_token_time = now
            if co.num_draft_tokens:
                m.num_spec_steps += 1
                m.num_draft_tokens += co.num_draft_tokens
                m.num_accepted_tokens += co.num_accepted_tokens
            if co.prompt_logprobs is not None:
                parent.prompt_logprobs = co.prompt_logprobs
            core_done = co.finish_reason is not None
            new_ids, new_lps = co.new_token_ids, co.new_logprobs
            text_ids = new_ids
            if core_done and isinstance(co.stop_reason, int) and not child.include_stop:
                text_ids = text_ids[:-1]  # EOS / stop token: not part of the text
            out.delta_text += child.detokenizer.update(text_ids, finished=core_done)
            out.text = child.detokenizer.output_text
            cut = child.detokenizer.stop_token_count
            if (
                cut is not None
            ):  # a stop string: drop the tokens after it (an accepted speculative run)
                new_ids = new_ids[:cut]
                new_lps = new_lps and new_lps[:cut]
            out.token_ids.extend(new_ids)
            out.delta_token_ids.extend(new_ids)
            if out.logprobs is not None and new_lps:
                out.logprobs.extend(new_lps)
            if child.detokenizer.stop_reason is not None:
                out.finish_reason, out.stop_reason = "stop", child.detokenizer.stop_reason
                if not core_done:
                    stopped.append(co.req_id)  # the scheduler still runs it: free it now
            elif core_done:
                out.finish_reason, out.stop_reason = co.finish_reason, co.stop_reason
            if out.finished:
                del self.children[co.req_id]
        return [self._finish_if_done(p) for p in touched.values()], stopped

    def _finish_if_done(self, parent: RequestOutput) -> RequestOutput:
        if all(o.finished for o in parent.outputs):
            parent.finished = True
            parent.metrics.finished_time = time.monotonic()
            self.parents.pop(parent.request_id, None)
        return parent
