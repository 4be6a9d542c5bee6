"""The server's own counters over a load test: `/metrics` read before and after the run, and
the difference. A tandem server (or the router, which sums its instances) gives the
prefix-cache hit ratio, preemptions by mode and the P/D KV transfers of just this run; a
tandem server's block size and pool give the ideal hit ratio to set it against."""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tandem.workload.prefix_ideal import ideal_prefix_hits

# sample name -> key in the report (counters only: their difference is the run's share)
COUNTERS = {
    "tandem:prefix_cache_queries_total": "prefix_cache_queries",
    "tandem:prefix_cache_hits_total": "prefix_cache_hits",
    "tandem:num_preemptions_total": "preemptions",
    "tandem:iteration_time_seconds_sum": "step_seconds",
    "tandem:iteration_time_seconds_count": "steps",
    "tandem_router:kv_transfer_bytes_total": "kv_transfer_bytes",
    "tandem_router:kv_transfer_seconds_sum": "kv_transfer_seconds",
    "tandem_router:kv_transfer_seconds_count": "kv_transfers",
}


def parse_counters(text: str) -> dict[str, float]:
    """COUNTERS summed over their labels (instances, models); preemptions also by mode."""
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            key = COUNTERS.get(s.name)
            if s.name == "tandem:preemptions_by_mode_total":
                key = f"preemptions_{s.labels.get('mode', 'unknown')}"
            if key:
                out[key] = out.get(key, 0.0) + s.value
    return out


def scrape(
    base_url: str, api_key: str | None = None, timeout: float = 10.0
) -> dict[str, float] | None:
    """The counters now, or None when the endpoint serves no readable /metrics."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        r = httpx.get(
            base_url.rstrip("/") + "/metrics", headers=headers, timeout=timeout, trust_env=False
        )
        return parse_counters(r.text) if r.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        return None


def run_counters(before: dict | None, after: dict | None) -> dict | None:
    """This run's share of each counter, and the prefix-cache hit ratio of its prompt tokens."""
    if before is None or after is None:
        return None
    delta = {k: v - before.get(k, 0.0) for k, v in after.items()}
    queries = delta.get("prefix_cache_queries")
    delta["prefix_cache_hit_ratio"] = (
        delta.get("prefix_cache_hits", 0.0) / queries if queries else None
    )
    return delta


def format_counters(c: dict | None) -> str:
    if c is None:
        return (
            "server counters: the endpoint serves no tandem /metrics "
            "(prefix-cache hit ratio unknown)"
        )
    ratio = c.get("prefix_cache_hit_ratio")
    hit = (
        f"prefix cache hit {ratio:.1%} of prompt tokens ({c['prefix_cache_hits']:.0f} of "
        f"{c['prefix_cache_queries']:.0f})"
        if ratio is not None
        else "prefix cache: no lookups (disabled?)"
    )
    pre = (
        f"preemptions {c.get('preemptions', 0):.0f} (swap {c.get('preemptions_swap', 0):.0f}, "
        f"recompute {c.get('preemptions_recompute', 0):.0f})"
    )
    kv = (
        f"; P/D KV transfers {c['kv_transfers']:.0f}, "
        f"{c.get('kv_transfer_bytes', 0) / 1e6:.1f} MB in "
        f"{c.get('kv_transfer_seconds', 0):.2f} s"
        if c.get("kv_transfers")
        else ""
    )
    return f"server counters over the run: {hit}; {pre}{kv}"


def kv_layout(
    base_url: str, api_key: str | None = None, timeout: float = 10.0
) -> tuple[int, int] | None:
    """(block size, KV blocks in the pool) of a tandem server, for the ideal hit ratio; None
    when the endpoint is not one (the router, another server)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        state = httpx.get(
            base_url.rstrip("/") + "/tandem/state",
            headers=headers,
            timeout=timeout,
            trust_env=False,
        )
        metrics = httpx.get(
            base_url.rstrip("/") + "/metrics", headers=headers, timeout=timeout, trust_env=False
        )
        blocks = sum(
            s.value
            for fam in text_string_to_metric_families(metrics.text)
            for s in fam.samples
            if s.name == "tandem:kv_cache_total_blocks"
        )
        return int(state.json()["block_size"]), int(blocks)
    except (httpx.HTTPError, ValueError, KeyError, TypeError):
        return None


def ideal_of(prompts: list[list[int]], block_size: int, blocks: int) -> dict:
    """The ideal hit ratio of the prompts sent, unbounded and within the server's KV pool."""
    return {
        "unbounded": ideal_prefix_hits(prompts, block_size),
        "cache_size": ideal_prefix_hits(prompts, block_size, blocks) if blocks else None,
    }


WARM_MARGIN = 0.05  # hit ratio above the prompts' own sharing that means a warm cache


def format_ideal(counters: dict | None, ideal: dict) -> str:
    got = (counters or {}).get("prefix_cache_hit_ratio")
    bounded = ideal["cache_size"] or ideal["unbounded"]
    line = (
        f"ideal prefix hit ratio at block size {ideal['unbounded']['block_size']}: "
        f"{ideal['unbounded']['token_ratio']:.1%} "
        f"(unbounded), {bounded['token_ratio']:.1%} (within {bounded['capacity_blocks']} KV blocks)"
    )
    if got is not None and bounded["token_ratio"]:
        line += (
            f"; achieved {got:.1%} = {got / bounded['token_ratio']:.0%} "
            "of the ideal the cache size allows"
        )
    if got is not None and got > ideal["unbounded"]["token_ratio"] + WARM_MARGIN:
        line += (
            "\nWARNING: the server hit more than this run's prompts share among themselves: "
            "it had them cached from an earlier run (the same --seed?), "
            "so its latency is not a cold server's"
        )
    return line


def warm_mismatch(counters: list[dict | None]) -> str | None:
    """A warning when two compared runs met prefix caches of different warmth: the ratios then
    measure the cache, not the servers."""
    ratios = [(c or {}).get("prefix_cache_hit_ratio") for c in counters]
    if None in ratios or abs(ratios[0] - ratios[1]) <= WARM_MARGIN:
        return None
    return (
        f"WARNING: the two runs hit the prefix cache on {ratios[0]:.1%} and {ratios[1]:.1%} "
        "of prompt tokens: one server had these prompts cached, "
        "so the ratios below are not like for like"
    )
