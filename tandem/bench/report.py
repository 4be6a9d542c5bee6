"""Figures for `tandem bench serve`: per-run summary (throughput, TTFT / ITL / TPOT / E2E
percentiles, SLO goodput, queue / prefill / decode split), aligned text tables, the
side-by-side comparison with ratios, and PNG plots."""

from __future__ import annotations

import math
import re
from collections import Counter
from pathlib import Path

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
QUEUE_SHARE_ALARM = 0.4  # MISSION D.14: queueing over 40% of latency means a scheduling problem


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


def format_run(
    run: dict,
    workload: dict,
    metrics: tuple[str, ...] = tuple(METRICS),
    pcts: tuple[float, ...] = PCTS,
) -> str:
    """The run as tables; the latency table shows `metrics` (--percentile-metrics) at `pcts`
    (--metric-percentiles), the JSON holds them all."""
    s, pt = run["summary"], workload["prompt_tokens"]
    lines = [
        f"==== tandem bench serve: {run['base_url']} ====",
        f"workload:  {workload['description']}",
        f"tokenizer: {workload['tokenizer']}{workload.get('tokenizer_note', '')}; "
        f"prompts with the exact token count: {pt['exact']}/{pt['prompts']}"
        + (f" ({pt['off']} off by up to {pt['max_abs_diff']} tokens)" if pt["off"] else ""),
    ]
    lines.append(
        table(
            [
                [k, fmt(v)]
                for k, v in (
                    ("completed", s["completed"]),
                    ("failed", s["failed"]),
                    ("duration (s)", s["duration_s"]),
                    ("request throughput (req/s)", s["request_throughput"]),
                    ("input throughput (tok/s)", s["input_throughput"]),
                    ("output throughput (tok/s)", s["output_throughput"]),
                    ("total input tokens", s["total_input_tokens"]),
                    ("total output tokens", s["total_output_tokens"]),
                )
            ]
        )
    )
    if s["failed"]:
        lines.append(
            "failures by status: "
            + ", ".join(f"{k}: {v}" for k, v in s["failures_by_status"].items())
        )
        lines.append(f"first error: {s['errors'][0]['error'][:200]}")
    cols = ["mean"] + [f"p{p:g}" for p in pcts]
    head = ["latency (ms)", *cols]
    rows = [[METRICS[m][0]] + [fmt(s[METRICS[m][1]][c]) for c in cols] for m in metrics]
    split = s["latency_split"]
    if split:
        rows += [
            [f"server {k}"] + [fmt(split[f"{k}_ms"].get(c)) for c in cols]
            for k in ("queue", "prefill", "decode")
        ]
    lines.append(table([head] + rows))
    for note in (s["itl_note"], s["usage_note"]):
        if note:
            lines.append(f"note: {note}")
    if s["goodput"]:
        g = s["goodput"]
        lines.append(
            f"goodput ({', '.join(f'{k}<={v:g}s' for k, v in g['slo_s'].items())}): "
            f"{g['rate']:.2f} req/s, {g['requests']}/{s['total']} requests "
            f"({g['share']:.1%}) met all SLOs"
        )
    if split:
        lines.append(
            f"latency split over {split['requests']} requests: queue {split['queue_share']:.1%}, "
            f"prefill {split['prefill_share']:.1%}, decode {split['decode_share']:.1%}, "
            f"other {split['other_share']:.1%} of E2E; queue share at >= p90 E2E "
            f"{split['tail_queue_share']:.1%}"
            + (
                "  <-- over 40%: a scheduling problem (MISSION D.14)"
                if split["scheduling_problem"]
                else ""
            )
        )
    if run["per_class"]:
        rows = [
            [
                "class",
                "done",
                "failed",
                "TTFT p50",
                "TTFT p99",
                "TPOT p50",
                "TPOT p99",
                "E2E p99",
                "out tok/s",
            ]
        ]
        for c, cs in run["per_class"].items():
            rows.append(
                [
                    c,
                    str(cs["completed"]),
                    str(cs["failed"]),
                    fmt(cs["ttft_ms"]["p50"]),
                    fmt(cs["ttft_ms"]["p99"]),
                    fmt(cs["tpot_ms"]["p50"]),
                    fmt(cs["tpot_ms"]["p99"]),
                    fmt(cs["e2e_ms"]["p99"]),
                    fmt(cs["output_throughput"]),
                ]
            )
        lines.append(table(rows))
    return "\n".join(lines)


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if k in ("errors", "failures_by_status", "slo_s") or k.endswith("_note"):
            continue
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        elif isinstance(v, (int, float)) and not isinstance(v, bool):
            out[prefix + k] = v
    return out


def ratios(s1: dict, s2: dict) -> dict:
    """summary2 / summary1 for every numeric figure (None where undefined)."""
    a, b = _flat(s1), _flat(s2)
    return {k: (b[k] / a[k] if a[k] and b.get(k) is not None else None) for k in a}


_SHOWN = re.compile(
    r"(completed|failed|duration_s|\w+_throughput|total_\w+_tokens"
    r"|(ttft|itl|tpot|e2e)_ms\.(mean|p50|p99)|goodput\.(rate|share)|latency_split\.(queue_share|tail_queue_share))"
)


def format_compare(run1: dict, run2: dict, r: dict) -> str:
    a, b = _flat(run1["summary"]), _flat(run2["summary"])
    rows = [["figure", run1["base_url"], run2["base_url"], "ratio 2/1"]]
    rows += [[k, fmt(a[k]), fmt(b.get(k)), fmt(r[k], 3)] for k in a if _SHOWN.fullmatch(k)]
    return "==== comparison (every figure's ratio is in --json) ====\n" + table(rows)


def write_plots(folder: Path, runs: list[dict]) -> list[str]:
    """TTFT CDF, ITL CDF, output tokens/s over time, requests in flight over time
    (one line per run)."""
    from tandem.workload.plots import pyplot, save_figure

    plt = pyplot()
    folder.mkdir(parents=True, exist_ok=True)
    paths = []

    def save(name: str, title: str, xlabel: str, ylabel: str, draw) -> None:
        fig, ax = plt.subplots(figsize=(7, 4))
        for i, run in enumerate(runs):
            draw(
                ax,
                [r for r in run["_raw"] if r["success"]],
                {**run, "label": f"{i + 1}: {run['base_url']}"},
            )
        ax.set(title=title, xlabel=xlabel, ylabel=ylabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        save_figure(fig, folder / name, 100)
        paths.append(str(folder / name))

    def cdf(values):
        return lambda ax, ok, run: ax.plot(
            np.sort(values(ok)) * 1000, np.linspace(0, 1, len(values(ok))), label=run["label"]
        )

    def throughput(ax, ok, run):
        dur = run["summary"]["duration_s"]
        width = max(0.05, dur / 60)
        times = [r["start"] + t for r in ok for t in r["chunk_times"]]
        weights = [r["output_tokens"] / r["num_chunks"] for r in ok for _ in r["chunk_times"]]
        hist, edges = np.histogram(
            times, bins=max(1, math.ceil(dur / width)), range=(0, max(dur, width)), weights=weights
        )
        ax.step(edges[:-1], hist / (edges[1] - edges[0]), where="post", label=run["label"])

    def inflight(ax, ok, run):
        events = sorted(
            [(r["start"], 1) for r in run["_raw"]] + [(r["end"], -1) for r in run["_raw"]]
        )
        ax.step(
            [0.0] + [t for t, _ in events],
            np.cumsum([0] + [d for _, d in events]),
            where="post",
            label=run["label"],
        )

    save(
        "ttft_cdf.png",
        "TTFT CDF",
        "TTFT (ms)",
        "fraction of requests",
        cdf(lambda ok: [r["ttft"] for r in ok]),
    )
    save(
        "itl_cdf.png",
        "ITL CDF",
        "inter-token latency (ms)",
        "fraction of gaps",
        cdf(lambda ok: [g for r in ok for g in r["itl"]]),
    )
    save("throughput.png", "output throughput", "time (s)", "output tokens/s", throughput)
    save("inflight.png", "requests in flight", "time (s)", "requests", inflight)
    return paths


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
