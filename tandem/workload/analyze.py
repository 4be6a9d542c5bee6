"""Workload figures from trace rows (pure, numpy only): length distributions, request rate over
time, tokens in flight (peak KV demand), ideal prefix reuse, and a serving recommendation whose
rules print the numbers that triggered them."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np

from tandem.workload.model_shapes import ModelShape, kv_bytes_per_token
from tandem.workload.traces import MOONCAKE_BLOCK_TOKENS, Row

SHORT_PROMPT_TOKENS = 200  # a chat turn: the short side of a mixed workload
LONG_PROMPT_TOKENS = 4000  # a document: long enough to stall short requests behind it
DISAGGREGATE_LONG_SHARE = 0.05  # this share of long prefills stalls the decodes sharing an instance
SHORT_CHAT_P50 = 2000  # prompt p50 at or under this: the bulk of the traffic is chat
PREFIX_CACHE_WORTH = 0.3  # ideal hit ratio from which a prefix cache (and prefix routing) pays
BURSTY_PEAK_TO_TROUGH = 2.0


def length_stats(values: np.ndarray) -> dict:
    v = np.asarray(values, dtype=float)
    p50, p75, p90, p95, p99 = np.percentile(v, [50, 75, 90, 95, 99])
    return {
        "mean": float(v.mean()),
        "p50": float(p50),
        "p75": float(p75),
        "p90": float(p90),
        "p95": float(p95),
        "p99": float(p99),
        "max": float(v.max()),
        f"share_under_{SHORT_PROMPT_TOKENS}": float((v < SHORT_PROMPT_TOKENS).mean()),
        f"share_over_{LONG_PROMPT_TOKENS}": float((v > LONG_PROMPT_TOKENS).mean()),
    }


def rate_curve(arrivals: np.ndarray, bin_seconds: float = 60.0) -> dict:
    """Requests/s per whole bin from the first arrival (a trailing partial bin is left out, so a
    short last bin cannot fake a trough); a trace shorter than one bin is one bin of its span."""
    span = float(arrivals.max())
    bins = int(span // bin_seconds)
    if bins == 0:
        curve = [len(arrivals) / max(span, 1.0)]
    else:
        counts = np.bincount((arrivals // bin_seconds).astype(int), minlength=bins + 1)[:bins]
        curve = (counts / bin_seconds).tolist()
    return {
        "bin_seconds": bin_seconds,
        "mean_rps": len(arrivals) / max(span, 1.0),
        "peak_rps": max(curve),
        "trough_rps": min(curve),
        "peak_rps_1s": int(np.bincount(arrivals.astype(int)).max()),
        "curve_rps": curve,
    }


def _sweep(
    starts: np.ndarray, ends: np.ndarray, weights: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Distinct event times and the level after each (a request ending when another starts does
    not overlap it)."""
    times = np.concatenate([starts, ends])
    order = np.argsort(times, kind="stable")
    times, level = times[order], np.cumsum(np.concatenate([weights, -weights])[order])
    last = np.append(times[1:] != times[:-1], True)
    return times[last], level[last]


def in_flight(arrivals: np.ndarray, tokens: np.ndarray, holds: np.ndarray) -> dict:
    """Tokens (prompt + output) and requests held from arrival for `holds` seconds; the curve
    is the peak of each second."""
    times, level = _sweep(arrivals, arrivals + holds, tokens.astype(float))
    _, reqs = _sweep(arrivals, arrivals + holds, np.ones(len(arrivals)))
    seconds = np.arange(int(math.ceil(times[-1])) + 1)
    at = np.searchsorted(times, seconds, side="right") - 1
    curve = np.where(at >= 0, level[np.maximum(at, 0)], 0.0)
    np.maximum.at(curve, times.astype(int), level)
    span = times[-1] - times[0]
    mean = float(np.sum(level[:-1] * np.diff(times)) / span) if span > 0 else float(level.max())
    return {
        "peak_tokens": int(level.max()),
        "mean_tokens": mean,
        "peak_requests": int(reqs.max()),
        "curve_tokens": curve.astype(int).tolist(),
    }


def prefix_reuse(rows: list[Row], block_tokens: int = MOONCAKE_BLOCK_TOKENS) -> dict | None:
    """Ideal (infinite) prefix cache over rows in arrival order: a request's leading blocks whose
    hash id an earlier request already had are hits. None when the trace has no hash ids."""
    if not any(r.hash_ids for r in rows):
        return None
    seen: set[int] = set()
    blocks = hit_blocks = tokens = hit_tokens = hit_requests = 0
    for r in rows:
        k = next((i for i, h in enumerate(r.hash_ids) if h not in seen), len(r.hash_ids))
        blocks, hit_blocks = blocks + len(r.hash_ids), hit_blocks + k
        tokens, hit_tokens = tokens + r.input_len, hit_tokens + min(k * block_tokens, r.input_len)
        hit_requests += k > 0
        seen.update(r.hash_ids)
    return {
        "block_tokens": block_tokens,
        "block_ratio": hit_blocks / max(blocks, 1),
        "token_ratio": hit_tokens / max(tokens, 1),
        "requests_with_hit": hit_requests / len(rows),
    }


@dataclass(slots=True)
class Recommendation:
    mode: str  # "colocated" (continuous batching) or "disaggregated" (P/D)
    reasons: list[str]
    l1_max_prompt_tokens: int
    l1_max_tokens: int
    l1_share: float  # requests the suggested classifier puts in L1 (output length as max_tokens)
    notes: list[str]


def recommend(
    prompts: np.ndarray,
    outputs: np.ndarray,
    prefix_ratio: float | None = None,
    peak_rps: float | None = None,
    trough_rps: float | None = None,
) -> Recommendation:
    """Explainable rules: the share of long prompts picks the mode, short requests set L1."""
    long_share = float((prompts > LONG_PROMPT_TOKENS).mean())
    p50, ratio = float(np.median(prompts)), float(prompts.sum() / max(outputs.sum(), 1))
    facts = (
        f"{long_share:.1%} of prompts over {LONG_PROMPT_TOKENS} tokens, prompt p50 {p50:.0f}, "
        f"prompt:output tokens {ratio:.1f}:1"
    )
    if long_share < DISAGGREGATE_LONG_SHARE:
        mode, why = (
            "colocated",
            (
                f"nearly all short ({facts}; under {DISAGGREGATE_LONG_SHARE:.0%} long): one "
                "instance type with continuous batching and chunked prefill is enough; a P/D "
                "KV transfer would be pure overhead"
            ),
        )
    elif p50 <= SHORT_CHAT_P50:
        mode, why = (
            "disaggregated",
            (
                f"few long documents + many short chats ({facts}): each long prefill "
                "stalls the decodes sharing its instance; disaggregate prefill and decode"
            ),
        )
    else:
        mode, why = (
            "disaggregated",
            (
                f"long prompts dominate ({facts}): prefill is most of the compute; "
                "separate prefill instances keep decode ITL steady"
            ),
        )
    short = prompts <= LONG_PROMPT_TOKENS if long_share < 1 else np.ones(len(prompts), bool)
    l1p = int(math.ceil(np.percentile(prompts[short], 50)))
    l1o = int(math.ceil(np.percentile(outputs[short], 75)))
    l1_share = float(((prompts <= l1p) & (outputs <= l1o)).mean())
    l1 = (
        f"L1 classifier: l1_max_prompt_tokens={l1p} (p50 of the {int(short.sum())} prompts <= "
        f"{LONG_PROMPT_TOKENS} tokens), l1_max_tokens={l1o} (p75 of their outputs): "
        f"{l1_share:.0%} of requests would be L1"
    )
    notes = []
    if mode == "disaggregated":
        notes.append(
            "disaggregation pays at 8+ accelerators; size P:D by token throughput (tandem plan); "
            "on one instance stay co-located with chunked prefill"
        )
    if prefix_ratio is not None:
        notes.append(
            f"ideal prefix-cache hit ratio {prefix_ratio:.1%} of prompt tokens: "
            + (
                "enable the prefix cache and route by prefix"
                if prefix_ratio >= PREFIX_CACHE_WORTH
                else "a prefix cache would save little"
            )
        )
    if (
        peak_rps is not None
        and trough_rps is not None
        and peak_rps >= BURSTY_PEAK_TO_TROUGH * trough_rps
    ):
        notes.append(
            f"bursty: per-bin rate from {trough_rps:.2f} to {peak_rps:.2f} req/s; "
            "size for the peak or let elastic instances switch roles"
        )
    return Recommendation(mode, [why, l1], l1p, l1o, l1_share, notes)


def analyze(
    rows: list[Row],
    shape: ModelShape,
    dtype_bytes: int = 2,
    decode_tps: float = 50.0,
    hold_seconds: float | None = None,
    bin_seconds: float = 60.0,
) -> dict:
    """Every figure of the report, JSON-ready."""
    if not rows:
        raise ValueError("no valid requests in the trace")
    if decode_tps <= 0 or bin_seconds <= 0 or (hold_seconds is not None and hold_seconds < 0):
        raise ValueError("--decode-tps and --bin-seconds must be positive, --hold-seconds >= 0")
    rows = sorted(rows, key=lambda r: r.arrival)
    arr = np.array([r.arrival for r in rows]) - rows[0].arrival
    prompts, outputs = np.array([r.input_len for r in rows]), np.array([r.output_len for r in rows])
    measured = np.array([np.nan if r.e2e is None else r.e2e for r in rows])
    if hold_seconds is not None:
        holds, how = (
            np.full(len(rows), hold_seconds),
            f"for a fixed {hold_seconds:g} s (--hold-seconds)",
        )
    else:
        holds = np.maximum(outputs, 1) / decode_tps
        how = f"until its output is decoded at {decode_tps:g} tok/s (--decode-tps)"
        if not np.isnan(measured).all():
            holds = np.where(np.isnan(measured), holds, np.maximum(measured, 0.0))
            how = (
                f"for its measured e2e_latency ({int((~np.isnan(measured)).sum())} rows), else "
                + how
            )
    kv = kv_bytes_per_token(shape, dtype_bytes)
    flight = in_flight(arr, prompts + outputs, holds)
    rate = rate_curve(arr, bin_seconds)
    reuse = prefix_reuse(rows)
    rec = recommend(
        prompts,
        outputs,
        None if reuse is None else reuse["token_ratio"],
        rate["peak_rps"],
        rate["trough_rps"],
    )
    return {
        "requests": len(rows),
        "duration_s": float(arr.max()),
        "prompt_tokens": length_stats(prompts),
        "output_tokens": length_stats(outputs),
        "prompt_output_ratio": float(prompts.sum() / max(outputs.sum(), 1)),
        "rate": rate,
        "in_flight": {
            "assumption": f"each request holds KV for prompt+output tokens from arrival {how}; "
            "no queueing, no prefix sharing",
            "model": shape.name,
            "dtype_bytes": dtype_bytes,
            "kv_bytes_per_token": kv,
            **flight,
            "peak_kv_bytes": flight["peak_tokens"] * kv,
        },
        "prefix_reuse": reuse,
        "recommendation": asdict(rec),
    }
