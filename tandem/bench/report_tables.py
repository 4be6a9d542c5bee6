"""The text of a `tandem bench serve` run: its summary as aligned tables, and two runs side
by side with the ratio of each figure."""

from __future__ import annotations

import re

from tandem.bench.report import (
    METRICS,
    PCTS,
    QUEUE_SHARE_ALARM,
    flat_figures,
    fmt,
    table,
    with_classes,
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
                f"  <-- over {QUEUE_SHARE_ALARM:.0%}: a scheduling problem, not the step time"
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


_SHOWN = re.compile(
    r"(completed|failed|duration_s|\w+_throughput|total_\w+_tokens"
    r"|(ttft|itl|tpot|e2e)_ms\.(mean|p50|p99)|goodput\.(rate|share)"
    r"|latency_split\.(queue_share|tail_queue_share)"
    r"|\w+\.(completed|(ttft|tpot|e2e)_ms\.(p50|p99)))"  # each class's (short.ttft_ms.p99)
)


def format_compare(run1: dict, run2: dict, r: dict) -> str:
    a, b = flat_figures(with_classes(run1)), flat_figures(with_classes(run2))
    rows = [["figure", run1["base_url"], run2["base_url"], "ratio 2/1"]]
    rows += [[k, fmt(a[k]), fmt(b.get(k)), fmt(r[k], 3)] for k in a if _SHOWN.fullmatch(k)]
    return "==== comparison (every figure's ratio is in --json) ====\n" + table(rows)
