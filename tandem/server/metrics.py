"""Prometheus metrics (Tandem's, and vLLM's names for those dashboards read: vllm_metrics.py)
and the per-request JSON-lines log, fed from AsyncLLM's receiver thread with each step's
outputs and the engine core's stats."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from tandem.config.request_class import LEVELS
from tandem.engine.async_llm import AsyncLLM
from tandem.engine.core_messages import SchedulerStats
from tandem.engine.output_processor import RequestOutput
from tandem.server.vllm_metrics import VllmNames

_LATENCY = (
    0.005,
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    10.0,
    20.0,
    40.0,
    80.0,
)
_COMPILE = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
_ITL = (0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5)


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


class _EngineCollector:
    """Engine state read at scrape time from the engine core's latest stats (sent with each
    step): queue sizes, KV pool, prefix cache, preemptions; precisions from the front end."""

    def __init__(self, llm: AsyncLLM, model: str) -> None:
        self.llm, self.model = llm, model

    def collect(self):
        s = self.llm.stats
        labels = ["model_name"]
        for name, doc, value in [
            ("tandem:num_requests_running", "Requests in the running batch.", s.num_running),
            ("tandem:num_requests_waiting", "Requests waiting to be scheduled.", s.num_waiting),
            (
                "tandem:kv_cache_usage_perc",
                "Share of KV blocks owned by requests (0-1).",
                s.kv_usage,
            ),
            (
                "tandem:kv_cache_free_blocks",
                "KV blocks free (including evictable cached ones).",
                s.kv_free_blocks,
            ),
            ("tandem:kv_cache_total_blocks", "KV blocks in the pool.", s.kv_total_blocks),
            (
                "tandem:kv_cache_utilization",
                "Tokens stored / capacity of owned blocks.",
                s.kv_utilization,
            ),
            ("tandem:kv_host_free_blocks", "Host-tier (swap) KV blocks free.", s.host_free_blocks),
            (
                "tandem:kv_host_total_blocks",
                "Host-tier (swap) KV blocks (0: no swap space).",
                s.host_total_blocks,
            ),
            (
                "tandem:num_requests_swapped",
                "Preempted requests whose KV is in the host tier.",
                s.num_swapped,
            ),
        ]:
            g = GaugeMetricFamily(name, doc, labels=labels)
            g.add_metric([self.model], value)
            yield g
        for name, doc, value in [
            (
                "tandem:prefix_cache_queries",
                "Prompt tokens looked up in the prefix cache.",
                s.prefix_queries,
            ),
            (
                "tandem:prefix_cache_hits",
                "Prompt tokens served from the prefix cache.",
                s.prefix_hits,
            ),
            (
                "tandem:num_preemptions",
                "Requests preempted (swap or recompute).",
                s.num_preemptions,
            ),
        ]:
            c = CounterMetricFamily(name, doc, labels=labels)
            c.add_metric([self.model], value)
            yield c
        yield from _precision_families(self.llm, self.model)
        yield from _spec_decode_families(s, self.model)
        by_mode = CounterMetricFamily(
            "tandem:preemptions_by_mode", "Preemptions by mode.", labels=labels + ["mode"]
        )
        for mode in ("swap", "recompute"):
            by_mode.add_metric([self.model, mode], s.preemptions_by_mode.get(mode, 0))
        yield by_mode
        for name, doc, counts in [
            (
                "tandem:num_requests_running_by_level",
                "Running requests per queue level.",
                s.running_by_level,
            ),
            (
                "tandem:num_requests_waiting_by_level",
                "Waiting requests per queue level.",
                s.waiting_by_level,
            ),
        ]:
            g = GaugeMetricFamily(name, doc, labels=labels + ["level"])
            for level in LEVELS:
                g.add_metric([self.model, f"L{level}"], counts.get(f"L{level}", 0))
            yield g


def _precision_families(llm: AsyncLLM, model: str):
    """Requests per precision served, fallbacks (requested, served, reason), weight bytes per
    variant."""
    router, lbl = llm.precisions, ["model_name"]
    by_precision = CounterMetricFamily(
        "tandem:requests_by_precision",
        "Requests by the precision that served them.",
        labels=lbl + ["precision"],
    )
    for precision in router.served:
        by_precision.add_metric([model, precision], router.requests_by_precision[precision])
    yield by_precision
    fallback = CounterMetricFamily(
        "tandem:precision_fallback",
        "Requests served by the fallback precision.",
        labels=lbl + ["requested", "served", "reason"],
    )
    for (requested, served, reason), count in router.fallbacks.items():
        fallback.add_metric([model, requested, served, reason], count)
    yield fallback
    weights = GaugeMetricFamily(
        "tandem:model_weight_bytes",
        "Bytes of weights each variant holds.",
        labels=lbl + ["precision"],
    )
    for precision, size in llm.weight_bytes.items():
        weights.add_metric([model, precision], size)
    yield weights


def _spec_decode_families(stats: SchedulerStats, model: str):
    """vLLM's speculative decoding counters (each exposed with a _total suffix)."""
    for name, doc, value in [
        (
            "tandem:spec_decode_num_drafts",
            "Verify steps: a request with drafts in a step.",
            stats.spec_num_drafts,
        ),
        (
            "tandem:spec_decode_num_draft_tokens",
            "Draft tokens verified.",
            stats.spec_num_draft_tokens,
        ),
        (
            "tandem:spec_decode_num_accepted_tokens",
            "Draft tokens accepted.",
            stats.spec_num_accepted_tokens,
        ),
    ]:
        c = CounterMetricFamily(name, doc, labels=["model_name"])
        c.add_metric([model], value)
        yield c
    per_pos = CounterMetricFamily(
        "tandem:spec_decode_num_accepted_tokens_per_pos",
        "Draft tokens accepted, by position in the draft (0 = first).",
        labels=["model_name", "position"],
    )
    for pos, value in enumerate(stats.spec_accepted_per_pos):
        per_pos.add_metric([model, str(pos)], value)
    yield per_pos


class ServerMetrics:
    def __init__(
        self, llm: AsyncLLM, model: str, request_log: str | None = None, log_text: bool = False
    ) -> None:
        self.registry = CollectorRegistry()
        self._log_text, self._tokenizer = log_text, llm.tokenizer
        self.model = model
        r, lbl = self.registry, ["model_name"]
        by_level = lbl + ["level"]
        self.ttft = Histogram(
            "tandem:time_to_first_token_seconds",
            "Time to first token.",
            by_level,
            buckets=_LATENCY,
            registry=r,
        )
        self.itl = Histogram(
            "tandem:inter_token_latency_seconds",
            "Time between output tokens.",
            lbl,
            buckets=_ITL,
            registry=r,
        )
        self.tpot = Histogram(
            "tandem:time_per_output_token_seconds",
            "Decode time per output token.",
            lbl,
            buckets=_ITL,
            registry=r,
        )
        self.e2e = Histogram(
            "tandem:e2e_request_latency_seconds",
            "End-to-end request latency.",
            lbl,
            buckets=_LATENCY,
            registry=r,
        )
        self.queue = Histogram(
            "tandem:request_queue_time_seconds",
            "Arrival to first schedule.",
            by_level,
            buckets=_LATENCY,
            registry=r,
        )
        self.prefill = Histogram(
            "tandem:request_prefill_time_seconds",
            "First schedule to first token.",
            lbl,
            buckets=_LATENCY,
            registry=r,
        )
        self.decode = Histogram(
            "tandem:request_decode_time_seconds",
            "First token to finish.",
            lbl,
            buckets=_LATENCY,
            registry=r,
        )
        self.step = Histogram(
            "tandem:iteration_time_seconds",
            "Engine step (iteration) time.",
            lbl,
            buckets=_ITL,
            registry=r,
        )
        self.prompt_tokens = Counter(
            "tandem:prompt_tokens", "Prompt tokens of finished requests.", lbl, registry=r
        )
        self.generation_tokens = Counter(
            "tandem:generation_tokens", "Generated tokens.", lbl, registry=r
        )
        self.finished = Counter(
            "tandem:request_success",
            "Finished requests by reason.",
            lbl + ["finished_reason"],
            registry=r,
        )
        self.structured_requests = Counter(
            "tandem:structured_output_requests",
            "Requests with an output constraint, by kind "
            "(json, json_object, regex, choice, grammar, tool_calls).",
            lbl + ["kind"],
            registry=r,
        )
        self.grammar_compile = Histogram(
            "tandem:grammar_compile_time_seconds",
            "Grammar compile time (cache misses).",
            lbl + ["kind"],
            buckets=_COMPILE,
            registry=r,
        )
        engine = _EngineCollector(llm, model)
        self.registry.register(engine)
        self.registry.register(
            VllmNames(
                [
                    engine,
                    self.ttft,
                    self.itl,
                    self.tpot,
                    self.e2e,
                    self.queue,
                    self.prefill,
                    self.decode,
                    self.prompt_tokens,
                    self.generation_tokens,
                    self.finished,
                ]
            )
        )
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
