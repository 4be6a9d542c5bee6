"""The server's own series, declared in its registry: request latency histograms (by queue
level where a dashboard splits them), step time, token and finish counters, structured output.
ServerMetrics updates them."""

from __future__ import annotations

from prometheus_client import Counter, Histogram

from tandem.server.vllm_metrics import VllmNamedRegistry

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


class MetricSeries:
    """The series ServerMetrics updates, in a registry of their own (which adds vLLM's names)."""

    def __init__(self) -> None:
        self.registry = r = VllmNamedRegistry()
        lbl = ["model_name"]
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
