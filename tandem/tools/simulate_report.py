"""`tandem simulate`'s report: a table row per simulated run (latency, goodput, KV use, the
prefix cache against its ideals), the P:D search, and each request class's figures."""

from __future__ import annotations

from tandem.bench.report import fmt, table


def _row(r: dict) -> list[str]:
    s, g, p = r["summary"], r["summary"]["goodput"], r["prefix_cache"]
    split = s["latency_split"] or {}
    pd = f"{r['prefill']}:{r['instances'] - r['prefill']}" if r["prefill"] else "-"
    return [
        str(r["instances"]),
        r["mode"],
        pd,
        r["policy"],
        str(s["completed"]),
        str(s["failed"]),
        fmt(s["ttft_ms"]["p50"]),
        fmt(s["ttft_ms"]["p90"]),
        fmt(s["ttft_ms"]["p99"]),
        fmt(s["itl_ms"]["p50"]),
        fmt(s["itl_ms"]["p99"]),
        fmt(s["e2e_ms"]["p50"]),
        fmt(s["e2e_ms"]["p90"]),
        fmt(g["rate"] if g else None),
        f"{g['share']:.1%}" if g else "-",
        f"{split.get('queue_share', 0):.1%}",
        f"{r['kv_usage_mean']:.1%}",
        *(
            [
                f"{p['hit_ratio']:.1%}",
                f"{p['ideal']:.1%}",
                f"{p['ideal_cache_size']:.1%}",
                f"{p['ideal_as_placed']:.1%}",
            ]
            if p
            else ["-"] * 4
        ),
        f"{r['sim_wall_s']:.1f}",
    ]


HEAD = [
    "N",
    "mode",
    "P:D",
    "policy",
    "done",
    "failed",
    "TTFT p50",
    "TTFT p90",
    "TTFT p99",
    "ITL p50",
    "ITL p99",
    "E2E p50",
    "E2E p90",
    "goodput/s",
    "good %",
    "queue",
    "KV use",
    "prefix hit",
    "ideal",
    "ideal @size",
    "as placed",
    "sim s",
]


def print_report(results: list[dict], searched: list[dict]) -> None:
    """The grid's runs (P/D at its best split) with the prefix columns' legend, every split the
    P:D search tried, then each request class's figures."""
    print(table([HEAD] + [_row(r) for r in results]))
    print(
        "prefix hit: share of prompt tokens the instances' caches served; "
        "ideal: an unbounded cache on the same prompts and block size; "
        "ideal @size: one LRU cache as large as all instances' KV pools; "
        "as placed: each instance's own LRU cache on the prompts routed to it"
    )
    if searched:
        print("P:D search (goodput/s by initial prefill count):")
        print(table([HEAD] + [_row(r) for r in searched]))
    for r in results:
        for c, cs in r["per_class"].items():
            print(
                f"  N={r['instances']} {r['mode']} {r['policy']} class {c}: TTFT p50/p99 "
                f"{fmt(cs['ttft_ms']['p50'])}/{fmt(cs['ttft_ms']['p99'])} ms, TPOT p50 "
                f"{fmt(cs['tpot_ms']['p50'])} ms, output {fmt(cs['output_throughput'])} tok/s"
            )
