"""Prometheus metrics (Tandem's series: metric_series.py; the engine's state: engine_metrics.py;
vLLM's names for those dashboards read: vllm_metrics.py) and the per-request JSON-lines log, fed
from AsyncLLM's receiver thread with each step's outputs and the engine core's stats."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

from tandem.engine.async_llm import AsyncLLM
from tandem.engine.core_messages import SchedulerStats
from tandem.engine.output_processor import RequestOutput
from tandem.server.engine_metrics import EngineCollector
from tandem.server.metric_series import MetricSeries


def request_timings(out: RequestOutput) -> dict[str, float]:
    """Queue, prefill and decode split of a finished request (seconds)."""
    m = out.metrics
    scheduled = m.first_scheduled_time or m.arrival_time
    first = m.first_token_time or scheduled
    end = m.finished_time or first
    return {
        "queue_time": scheduled - m.arrival_time,
        "prefill_time": first - scheduled,
        "decode_time": end - first,
        "ttft": first - m.arrival_time,
        "e2e": end - m.arrival_time,
    }


class ServerMetrics(MetricSeries):
    def __init__(
        self, llm: AsyncLLM, model: str, request_log: str | None = None, log_text: bool = False
    ) -> None:
        super().__init__()
        self._log_text, self._tokenizer = log_text, llm.tokenizer
        self.model = model
        self.registry.register(EngineCollector(llm, model))
        self._last_token: dict[str, float] = {}
        self._log_path = Path(request_log) if request_log else None
        self._log_lock = threading.Lock()
        if self._log_path:
            self._log_path.parent.mkdir(parents=True, exist_ok=True)

    def on_step(
        self, elapsed: float | None, outputs: list[RequestOutput], stats: SchedulerStats | None
    ) -> None:
        """AsyncLLM.on_step: a step's outputs (elapsed: its seconds), or requests that ended
        outside a step (None); the stats it came with."""
        now = time.monotonic()
        for kind, seconds in stats.grammar_compiles if stats is not None else ():
            self.grammar_compile.labels(self.model, kind).observe(seconds)
        if elapsed is not None:
            self.step.labels(self.model).observe(elapsed)
        for out in outputs:
            new = sum(len(o.delta_token_ids) for o in out.outputs)
            self.generation_tokens.labels(self.model).inc(new)
            last = self._last_token.get(out.request_id)
            if last is None:
                if out.metrics.first_token_time is not None:
                    self.ttft.labels(self.model, f"L{out.priority}").observe(
                        out.metrics.first_token_time - out.metrics.arrival_time
                    )
            elif new:
                gap = (now - last) / new
                for _ in range(new):
                    self.itl.labels(self.model).observe(gap)
            self._last_token[out.request_id] = now
            if out.finished:
                self._last_token.pop(out.request_id, None)
                self.on_finished(out)

    def on_finished(self, out: RequestOutput) -> None:
        t = request_timings(out)
        m = self.model
        self.e2e.labels(m).observe(t["e2e"])
        self.queue.labels(m, f"L{out.priority}").observe(t["queue_time"])
        self.prefill.labels(m).observe(t["prefill_time"])
        self.decode.labels(m).observe(t["decode_time"])
        num_out = sum(len(o.token_ids) for o in out.outputs)
        if num_out > len(out.outputs):
            self.tpot.labels(m).observe(t["decode_time"] / (num_out - len(out.outputs)))
        self.prompt_tokens.labels(m).inc(len(out.prompt_token_ids))
        for o in out.outputs:
            self.finished.labels(m, o.finish_reason or "abort").inc()
        if self._log_path:
            self.log_request(out, t, num_out)

    def log_request(self, out: RequestOutput, t: dict[str, float], num_out: int) -> None:
        """One JSON line per finished request, in the shape the workload analyzer reads: lengths
        and timings, no text unless the server was asked to log it."""
        decode_tokens = max(num_out - len(out.outputs), 0)
        line = {
            "request_id": out.request_id,
            "arrival_time": time.time() - (time.monotonic() - out.metrics.arrival_time),
            "prompt_tokens": len(out.prompt_token_ids),
            "output_tokens": num_out,
            "cached_prompt_tokens": out.metrics.num_cached_tokens,
            "priority": out.priority,
            "precision": out.precision,
            "queue_time": t["queue_time"],
            "ttft": t["ttft"],
            "mean_itl": t["decode_time"] / decode_tokens if decode_tokens else 0.0,
            "e2e_latency": t["e2e"],
            "finish_reason": ",".join(o.finish_reason or "abort" for o in out.outputs),
        }
        if self._log_text:  # asked for (--request-log-text): the text, not only its length
            tok = self._tokenizer
            line["prompt"] = (
                tok.decode(out.prompt_token_ids) if tok is not None else out.prompt_token_ids
            )
            line["outputs"] = [o.text for o in out.outputs]
        m = out.metrics
        if m.num_spec_steps:  # speculative decoding: this request's acceptance
            line["spec_acceptance_rate"] = m.num_accepted_tokens / m.num_draft_tokens
            line["spec_mean_accepted_length"] = 1 + m.num_accepted_tokens / m.num_spec_steps
        with self._log_lock, self._log_path.open("a") as f:
            f.write(json.dumps(line) + "\n")
