"""guidellm's JSON reports (one per server and concurrency, named SERVER-STREAMS.json) as one
Markdown table: requests completed, output tokens per second over the run, and the medians of
time to first token and inter-token latency.

    python scripts/guidellm_table.py OUT/*.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def row(path: Path) -> tuple[int, str, str]:
    server, streams = path.stem.rsplit("-", 1)
    bench = json.load(open(path))["benchmarks"][0]
    m = bench["metrics"]
    totals = m["request_totals"]
    tokens = m["output_token_count"]["successful"]["total_sum"]

    def median(name: str) -> str:
        return f"{m[name]['successful']['median']:.0f}"

    cells = [
        server,
        streams,
        f"{totals['successful']}/{totals['total']}",
        f"{tokens / bench['duration']:.1f}",
        median("time_to_first_token_ms"),
        median("inter_token_latency_ms"),
    ]
    return int(streams), server, "| " + " | ".join(cells) + " |"


def main(paths: list[str]) -> None:
    print("| Server | Concurrency | Requests ok | Output tok/s | TTFT p50 ms | ITL p50 ms |")
    print("|---|---|---|---|---|---|")
    for _, _, line in sorted(row(Path(p)) for p in paths):
        print(line)


if __name__ == "__main__":
    main(sys.argv[1:])
