"""What /dashboard shows, computed from the process's own Prometheus exposition (the server's
registry, or the router's merged cluster page): gauges as they are now, and over the last
minute the prefix-cache hit ratio, TTFT / ITL / E2E percentiles (interpolated within
histogram buckets, as PromQL's histogram_quantile does, so the page and the Grafana panels
agree), output tokens/s and preemptions by mode. A sample is taken each time the page asks
(every 1-2 s), so nothing runs while nobody watches; points are kept for HISTORY_S. Until a
page has watched for a minute the window is shorter: each point says how long (window_s)."""

from __future__ import annotations

import math
import threading
import time
from collections import defaultdict, deque

from prometheus_client.parser import text_string_to_metric_families

WINDOW_S = 60.0  # latency percentiles, hit ratio: over this much of the past
RATE_S = 5.0  # tokens/s and preemptions/s: over this much
HISTORY_S = 600.0
MIN_INTERVAL_S = 0.5  # pages polling more often (or several pages) share a sample
QUANTILES = (0.5, 0.9, 0.99)
HISTOGRAMS = {
    "ttft": "tandem:time_to_first_token_seconds",
    "itl": "tandem:inter_token_latency_seconds",
    "e2e": "tandem:e2e_request_latency_seconds",
}


def parse(text: str) -> dict:
    """Exposition text -> {"values": {sample name, name|label value, or name#n (how many
    samples were summed): summed value},
    "buckets": {histogram: {le: summed count}}}, summed over models and instances, and the
    same per model under "models" ({model_name: {"values", "buckets"}})."""
    total = _sums()
    models: dict[str, dict] = defaultdict(_sums)
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            _add(total, s)
            if s.labels.get("model_name"):
                _add(models[s.labels["model_name"]], s)
    out = _plain(total)
    out["models"] = {m: _plain(v) for m, v in sorted(models.items())}
    return out


def _sums() -> dict:
    return {"values": defaultdict(float), "buckets": defaultdict(lambda: defaultdict(float))}


def _add(into: dict, s) -> None:
    if s.name.endswith("_bucket"):
        into["buckets"][s.name[:-7]][float(s.labels["le"])] += s.value
        return
    values = into["values"]
    values[s.name] += s.value
    values[f"{s.name}#n"] += 1
    for key in ("level", "mode"):
        if key in s.labels:
            values[f"{s.name}|{s.labels[key]}"] += s.value


def _plain(sums: dict) -> dict:
    return {
        "values": dict(sums["values"]),
        "buckets": {k: dict(v) for k, v in sums["buckets"].items()},
    }


def quantile(q: float, buckets: dict[float, float]) -> float | None:
    """histogram_quantile over cumulative bucket counts {le: count}; None with no observations."""
    edges = sorted(buckets)
    if not edges or buckets[edges[-1]] <= 0:
        return None
    rank, prev_le, prev_count = q * buckets[edges[-1]], 0.0, 0.0
    for le in edges:
        count = buckets[le]
        if count >= rank:
            if math.isinf(le):
                return prev_le  # beyond the last finite bucket: its upper bound, as Prometheus does
            return prev_le + (le - prev_le) * (
                (rank - prev_count) / (count - prev_count) if count > prev_count else 1.0
            )
        prev_le, prev_count = le, count
    return None


def _delta(now: dict, then: dict | None, key: str) -> float:
    return now["values"].get(key, 0.0) - (then["values"].get(key, 0.0) if then else 0.0)


def _window_quantile(q: float, name: str, cur: dict, window: dict | None) -> float | None:
    """Milliseconds: the q-quantile of the observations of histogram `name` made within the
    window."""
    b = cur["buckets"].get(name, {})
    old = window["buckets"].get(name, {}) if window else {}
    x = quantile(q, {le: c - old.get(le, 0.0) for le, c in b.items()})
    return None if x is None else x * 1e3


def _model_point(
    cur: dict, window: dict | None, recent: dict | None, rate_dt: float | None
) -> dict:
    """One model's row: its requests finished per second (chat and embeddings), queue, output
    tokens/s, TTFT / E2E over the window and KV usage (the mean over its instances)."""
    v = cur["values"]

    def rate(*names: str) -> float | None:
        if recent is None or not rate_dt:
            return None
        return sum(_delta(cur, recent, n) for n in names) / rate_dt

    kv_n = v.get("tandem:kv_cache_usage_perc#n", 0.0)
    embed = "tandem:embedding_latency_seconds"
    return {
        "requests_s": rate("tandem:request_success_total", "tandem:embedding_requests_total"),
        "running": v.get("tandem:num_requests_running", 0.0),
        "waiting": v.get("tandem:num_requests_waiting", 0.0),
        "output_tok_s": rate("tandem:generation_tokens_total"),
        "ttft_p50_ms": _window_quantile(0.5, HISTOGRAMS["ttft"], cur, window),
        "ttft_p99_ms": _window_quantile(0.99, HISTOGRAMS["ttft"], cur, window),
        "e2e_p50_ms": _window_quantile(
            0.5, embed if embed in cur["buckets"] else HISTOGRAMS["e2e"], cur, window
        ),
        "kv_usage": v.get("tandem:kv_cache_usage_perc", 0.0) / kv_n if kv_n else None,
    }


class DashboardSeries:
    """Samples of the exposition over time, and the figures the page charts."""

    def __init__(self) -> None:
        self.samples: deque[tuple[float, dict]] = deque()  # (monotonic time, parsed)
        self.points: deque[dict] = deque()
        self.lock = threading.Lock()

    def _at(self, t: float) -> tuple[float | None, dict | None]:
        """The newest sample at or before t, else the oldest kept; (None, None) before any."""
        older = [s for s in self.samples if s[0] <= t]
        return older[-1] if older else (self.samples[0] if self.samples else (None, None))

    def add(self, text: str, now: float | None = None) -> dict:
        """Take a sample; return the point it makes (also kept for the charts)."""
        now = time.monotonic() if now is None else now
        with self.lock:
            if self.samples and now - self.samples[-1][0] < MIN_INTERVAL_S and self.points:
                return self.points[-1]
        cur = parse(text)
        with self.lock:
            window_t, window = self._at(now - WINDOW_S)
            recent_t, recent = self._at(now - RATE_S)
            rate_dt = now - recent_t if recent_t is not None else None
            self.samples.append((now, cur))
            while self.samples and self.samples[0][0] < now - HISTORY_S:
                self.samples.popleft()
            point = self._point(now, cur, window, recent, rate_dt)
            point["window_s"] = (
                now - window_t if window_t is not None else None
            )  # None: since the start
            self.points.append(point)
            while self.points and self.points[0]["t"] < time.time() - HISTORY_S:
                self.points.popleft()
        return point

    def _point(
        self, now: float, cur: dict, window: dict | None, recent: dict | None, rate_dt: float | None
    ) -> dict:
        v = cur["values"]
        p: dict = {"t": time.time()}
        for name in HISTOGRAMS:  # percentiles of the observations made within the window
            for q in QUANTILES:
                p[f"{name}_p{round(q * 100)}_ms"] = _window_quantile(
                    q, HISTOGRAMS[name], cur, window
                )
        n = _delta(cur, window, "tandem_router:kv_transfer_seconds_count")
        p["kv_transfer_ms"] = (
            _delta(cur, window, "tandem_router:kv_transfer_seconds_sum") / n * 1e3 if n else None
        )
        queries = _delta(cur, window, "tandem:prefix_cache_queries_total")
        p["prefix_hit_ratio"] = (
            _delta(cur, window, "tandem:prefix_cache_hits_total") / queries if queries else None
        )
        for key, name in (
            ("output_tok_s", "tandem:generation_tokens_total"),
            ("preempt_swap_s", "tandem:preemptions_by_mode_total|swap"),
            ("preempt_recompute_s", "tandem:preemptions_by_mode_total|recompute"),
            ("kv_transfer_mb_s", "tandem_router:kv_transfer_bytes_total"),
        ):
            d = _delta(cur, recent, name) if recent else None
            p[key] = (
                d / rate_dt / (1e6 if key == "kv_transfer_mb_s" else 1)
                if d is not None and rate_dt
                else None
            )
        for level in ("L1", "L2", "L3"):
            p[f"running_{level}"] = v.get(f"tandem:num_requests_running_by_level|{level}", 0.0)
            p[f"waiting_{level}"] = v.get(f"tandem:num_requests_waiting_by_level|{level}", 0.0)
        for key, name in (
            ("kv_usage", "tandem:kv_cache_usage_perc"),
            ("kv_utilization", "tandem:kv_cache_utilization"),
        ):
            p[key] = v.get(name, 0.0) / max(v.get(name + "#n", 1.0), 1.0)  # the mean over instances
        p["kv_free_blocks"], p["kv_total_blocks"] = (
            v.get("tandem:kv_cache_free_blocks", 0.0),
            v.get("tandem:kv_cache_total_blocks", 0.0),
        )
        host = v.get("tandem:kv_host_total_blocks", 0.0)
        p["host_used"] = 1 - v.get("tandem:kv_host_free_blocks", 0.0) / host if host else None
        p["swapped"] = v.get("tandem:num_requests_swapped", 0.0)
        p["preemptions_swap"] = v.get("tandem:preemptions_by_mode_total|swap", 0.0)
        p["preemptions_recompute"] = v.get("tandem:preemptions_by_mode_total|recompute", 0.0)
        p["kv_transfers"] = v.get("tandem_router:kv_transfer_seconds_count", 0.0)
        empty = {"values": {}, "buckets": {}}  # a model the older sample had not seen yet

        def then(sample: dict | None, m: str) -> dict | None:
            return None if sample is None else sample["models"].get(m, empty)

        p["models"] = {
            m: _model_point(c, then(window, m), then(recent, m), rate_dt)
            for m, c in cur["models"].items()
        }
        return p

    def series(self) -> dict[str, list]:
        """Column arrays of every point (the uPlot data layout); the per-model rows are the
        latest point's only."""
        with self.lock:
            points = list(self.points)
        return {k: [p[k] for p in points] for k in (points[0] if points else {}) if k != "models"}
