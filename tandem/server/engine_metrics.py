"""The engine's side of /metrics: families built at scrape time, not series updated per step."""

from __future__ import annotations

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from tandem.config.request_class import LEVELS
from tandem.engine.async_llm import AsyncLLM
from tandem.engine.core_messages import SchedulerStats


class EngineCollector:
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
        yield from _lora_families(s, self.model)
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


def _lora_families(s: SchedulerStats, model: str):
    """Per LoRA adapter: requests, tokens run, loads and evictions (counters)."""
    for key, doc in [
        ("requests", "Sequences added with the LoRA adapter."),
        ("tokens", "Tokens (prompt and output) run with the LoRA adapter."),
        ("loads", "Loads of the LoRA adapter from its folder."),
        ("evictions", "Evictions of the LoRA adapter from a resident slot."),
    ]:
        c = CounterMetricFamily(f"tandem:lora_{key}", doc, labels=["model_name", "lora_name"])
        for name, figures in sorted(s.lora.items()):
            c.add_metric([model, name], figures.get(key, 0))
        yield c
