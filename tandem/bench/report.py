"""Figures for `tandem bench serve`: per-run summary (throughput, TTFT / ITL / TPOT / E2E
percentiles, SLO goodput, queue / prefill / decode split), the ratios of two runs, and the
number and table formatting the bench reports share."""

from __future__ import annotations

import math
from collections import Counter

import numpy as np

PCTS = (50, 90, 95, 99)
GOODPUT_KEYS = {"ttft": "ttft", "tpot": "tpot", "e2el": "e2e"}  # --goodput key -> record key
METRICS = {
    "ttft": ("TTFT", "ttft_ms"),
    "itl": ("ITL", "itl_ms"),
    "tpot": ("TPOT", "tpot_ms"),
    "e2el": ("E2E", "e2e_ms"),
}
SPLIT_KEYS = ("queue_time", "prefill_time", "decode_time")
# Requests waiting in the queue for over 40% of their latency: the scheduler, not the step
# time, is what to fix.
QUEUE_SHARE_ALARM = 0.4


def parse_goodput(pairs: list[str] | None) -> dict[str, float]:
    """vLLM's --goodput ["ttft:500", "tpot:100", "e2el:10000"] (milliseconds) -> {"ttft": 0.5, ...}
    (seconds; e2el is kept as "e2e", the key of the per-request records)."""
    slo = {}
    for part in pairs or []:
        key, _, value = part.partition(":")
        key = key.strip().lower()
        try:
            ms = float(value)
        except ValueError:
            raise ValueError(
                f"--goodput: bad value in {part!r}; expected e.g. ttft:500 tpot:100 e2el:10000 (ms)"
            ) from None
        if key not in GOODPUT_KEYS or ms <= 0:
            raise ValueError(
                f"--goodput: {part!r}: keys are {', '.join(GOODPUT_KEYS)} "
                "with positive milliseconds"
            )
        slo[GOODPUT_KEYS[key]] = ms / 1000.0
    return slo


def stats_ms(values_s, pcts: tuple[float, ...] = PCTS) -> dict:
    v = np.asarray([x for x in values_s if x is not None], dtype=float) * 1000.0
    if v.size == 0:
        return {"mean": None, **{f"p{p:g}": None for p in pcts}}
    return {"mean": float(v.mean()), **{f"p{p:g}": float(np.percentile(v, p)) for p in pcts}}


def _failure_kind(r: dict) -> str:
    if r["status"] not in (None, 200):
        return str(r["status"])
    return (
        "timeout"
        if r["error"].startswith("timeout")
        else ("stream" if r["status"] == 200 else "connection")
    )


def goodput(ok: list[dict], total: int, duration: float, slo: dict) -> dict | None:
    if not slo:
        return None
    good = sum(all((r[k] or 0.0) <= limit for k, limit in slo.items()) for r in ok)
    return {
        "slo_s": slo,
        "requests": good,
        "rate": good / duration,
        "share": good / total if total else 0.0,
    }


def latency_split(ok: list[dict]) -> dict | None:
    """Server-reported queue / prefill / decode times against client-side E2E."""
    rows = [r for r in ok if r["metrics"]]
    if not rows:
        return None
    part = {k: np.array([float(r["metrics"].get(k) or 0.0) for r in rows]) for k in SPLIT_KEYS}
    e2e = np.array([r["e2e"] for r in rows])
    tail = e2e >= np.percentile(e2e, 90)
    out = {
        "requests": len(rows),
        **{f"{k.removesuffix('_time')}_ms": stats_ms(part[k]) for k in SPLIT_KEYS},
    }
    for k in SPLIT_KEYS:
        out[f"{k.removesuffix('_time')}_share"] = float(part[k].sum() / e2e.sum())
    out["other_share"] = 1.0 - sum(out[f"{k.removesuffix('_time')}_share"] for k in SPLIT_KEYS)
    out["tail_queue_share"] = float(part["queue_time"][tail].sum() / e2e[tail].sum())
    out["scheduling_problem"] = out["queue_share"] > QUEUE_SHARE_ALARM
    return out


def summarize(
    results: list[dict], duration: float, slo: dict, pcts: tuple[float, ...] = PCTS
) -> dict:
    ok = [r for r in results if r["success"]]
    bad = [r for r in results if not r["success"]]
    duration = max(duration, 1e-9)
    tin = sum(r["prompt_tokens"] if r["prompt_tokens"] is not None else r["input_len"] for r in ok)
    tout = sum(r["output_tokens"] for r in ok)
    s = {
        "total": len(results),
        "completed": len(ok),
        "failed": len(bad),
        "duration_s": duration,
        "request_throughput": len(ok) / duration,
        "input_throughput": tin / duration,
        "output_throughput": tout / duration,
        "total_input_tokens": tin,
        "total_output_tokens": tout,
        "ttft_ms": stats_ms((r["ttft"] for r in ok), pcts),
        "itl_ms": stats_ms((g for r in ok for g in r["itl"]), pcts),
        "tpot_ms": stats_ms((r["tpot"] for r in ok), pcts),
        "e2e_ms": stats_ms((r["e2e"] for r in ok), pcts),
        "failures_by_status": dict(Counter(_failure_kind(r) for r in bad)),
        "errors": [
            {"index": r["index"], "status": r["status"], "error": r["error"]} for r in bad[:10]
        ],
        "goodput": goodput(ok, len(results), duration, slo),
        "latency_split": latency_split(ok),
    }
    multi = [r for r in ok if r["num_chunks"] < r["output_tokens"]]
    s["itl_note"] = (
        None
        if not multi
        else (
            f"{len(multi)} of {len(ok)} requests streamed fewer chunks than output tokens "
            f"({sum(r['output_tokens'] for r in multi) / sum(r['num_chunks'] for r in multi):.2f} "
            "tokens/chunk): "
            "ITL is measured per chunk, TPOT per token"
        )
    )
    missing = len(ok) - sum(r["usage_reported"] for r in ok)
    s["usage_note"] = (
        None if not missing else f"{missing} requests sent no usage; output tokens = chunks"
    )
    return s


def build_run(
    url: str, results: list[dict], duration: float, slo: dict, pcts: tuple[float, ...] = PCTS
) -> dict:
    classes = sorted({r["cls"] for r in results})
    slim = (
        "index",
        "cls",
        "success",
        "status",
        "error",
        "start",
        "ttft",
        "tpot",
        "e2e",
        "output_tokens",
        "num_chunks",
        "input_len",
        "prompt_tokens",
        "requested_output",
        "hash_ids",
        "block_tokens",
        "metrics",
    )
    return {
        "base_url": url,
        "summary": summarize(results, duration, slo, pcts),
        "per_class": {
            c: summarize([r for r in results if r["cls"] == c], duration, slo, pcts)
            for c in classes
        }
        if len(classes) > 1
        else {},
        "requests": [{k: r[k] for k in slim} for r in results],
        "_raw": results,
    }


def flat_figures(d: dict, prefix: str = "") -> dict:
    """Every numeric figure of a summary under its dotted key ("ttft_ms.p99")."""
    out = {}
    for k, v in d.items():
        if k in ("errors", "failures_by_status", "slo_s") or k.endswith("_note"):
            continue
        if isinstance(v, dict):
            out.update(flat_figures(v, f"{prefix}{k}."))
        elif isinstance(v, (int, float)) and not isinstance(v, bool):
            out[prefix + k] = v
    return out


def with_classes(run: dict) -> dict:
    """A run's summary with each class's summary beside it, so that flat_figures and ratios give
    the classes' figures too ("short.ttft_ms.p99")."""
    return {**run["summary"], **run["per_class"]}


def ratios(s1: dict, s2: dict) -> dict:
    """summary2 / summary1 for every numeric figure (None where undefined)."""
    a, b = flat_figures(s1), flat_figures(s2)
    return {k: (b[k] / a[k] if a[k] and b.get(k) is not None else None) for k in a}


def mib(num_bytes: float) -> str:
    """Bytes as the reports print them: "12.3 MiB"."""
    return f"{num_bytes / 2**20:.1f} MiB"


def fmt(v, digits: int = 2) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:,.{digits}f}"
    return str(v)


def table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join(
        "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
        for r in rows
    )


def jsonable(x):
    """Strict JSON: drop private keys, infinities and NaN become strings."""
    if isinstance(x, dict):
        return {str(k): jsonable(v) for k, v in x.items() if not str(k).startswith("_")}
    if isinstance(x, (list, tuple)):
        return [jsonable(v) for v in x]
    if isinstance(x, (float, np.floating)):
        return float(x) if math.isfinite(x) else str(float(x))
    if isinstance(x, np.integer):
        return int(x)
    return x
