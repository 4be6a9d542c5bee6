"""The series vLLM dashboards read (Grafana boards, KEDA autoscalers, llm-d's scheduler), under
vLLM's `vllm:` names beside Tandem's own: the same values, read from Tandem's collectors at
scrape time, renamed. Tandem's series keep their extra labels (a request's queue level)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import Metric

# Tandem's name (after "tandem:") -> vLLM's names for it
VLLM_NAMES = {
    name: (name,)
    for name in (
        "num_requests_running",
        "num_requests_waiting",
        "num_preemptions",
        "prefix_cache_queries",
        "prefix_cache_hits",
        "prompt_tokens",
        "generation_tokens",
        "request_success",
        "time_to_first_token_seconds",
        "inter_token_latency_seconds",
        "time_per_output_token_seconds",
        "e2e_request_latency_seconds",
        "request_queue_time_seconds",
        "request_prefill_time_seconds",
        "request_decode_time_seconds",
        "spec_decode_num_drafts",
        "spec_decode_num_draft_tokens",
        "spec_decode_num_accepted_tokens",
    )
}
VLLM_NAMES["kv_cache_usage_perc"] = ("kv_cache_usage_perc", "gpu_cache_usage_perc")  # v1, v0


class VllmNamedRegistry(CollectorRegistry):
    """A registry whose families listed in VLLM_NAMES come out again under vLLM's names, renamed
    as they are collected: each collector is read once per scrape."""

    def collect(self):
        for family in super().collect():
            yield family
            short = family.name.removeprefix("tandem:")
            for name in VLLM_NAMES.get(short, ()) if short != family.name else ():
                renamed = Metric(f"vllm:{name}", family.documentation, family.type)
                renamed.samples = [
                    s._replace(name=s.name.replace(family.name, renamed.name, 1))
                    for s in family.samples
                ]
                yield renamed
