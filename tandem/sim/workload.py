"""Requests for the simulator: a window of a real trace (scaled like `tandem bench serve`
scales it), the exact requests of a recorded `tandem bench serve --save-result` run (for fidelity
checks), or a synthetic long + short mix."""

from __future__ import annotations

import json
import random
from pathlib import Path

from tandem.sim.request import TRACE_BLOCK_TOKENS, SimRequest
from tandem.workload.traces import read_trace, resolve_trace, select

CLASS_PRIORITY = {"short": 1, "long": 2}  # bench serve --priority-by-class


def from_trace(
    trace: str,
    start: float = 0.0,
    seconds: float | None = None,
    max_requests: int | None = None,
    time_scale: float = 1.0,
    length_scale: float = 1.0,
    strict: bool = False,
) -> tuple[list[SimRequest], dict]:
    """`trace` is a path, or azure / mooncake for the shipped traces."""
    path = resolve_trace(trace)
    if length_scale <= 0:
        raise ValueError("--length-scale must be positive")
    rows, skipped = read_trace(path, strict)
    picked = select(rows, start, seconds, max_requests, time_scale)
    if not picked:
        raise ValueError(f"{path}: no requests in the selected window ({len(rows)} rows parsed)")
    reqs = [
        SimRequest(
            i,
            r.arrival,
            max(1, round(r.input_len * length_scale)),
            max(1, round(r.output_len * length_scale)),
            hash_ids=tuple(r.hash_ids),
        )
        for i, r in enumerate(picked)
    ]
    return reqs, {
        "trace": str(path),
        "rows_parsed": len(rows),
        "skipped_lines": len(skipped),
        "skipped": skipped[:20],
        "num_requests": len(reqs),
        "window_start_s": start,
        "window_seconds": seconds,
        "time_scale": time_scale,
        "length_scale": length_scale,
        "span_s": picked[-1].arrival,
    }


def from_bench_run(path: str) -> tuple[list[SimRequest], dict]:
    """The requests a `tandem bench serve --save-result` run sent, at the times it sent them, with
    the prompt lengths the server counted (chat template included) and a trace's prefix blocks
    as the run scaled them."""
    try:
        data = json.loads(Path(path).read_text())
        by_class = bool(data.get("config", {}).get("priority_by_class"))
        reqs = [
            SimRequest(
                int(r["index"]),
                float(r["start"]),
                int(r["prompt_tokens"] or r["input_len"]),
                int(r["requested_output"]),
                cls=r.get("cls", "all"),
                priority=CLASS_PRIORITY.get(r.get("cls")) if by_class else None,
                hash_ids=tuple(int(h) for h in r.get("hash_ids") or ()),
                block_tokens=int(r.get("block_tokens") or TRACE_BLOCK_TOKENS),
            )
            for r in data["results"]["requests"]
        ]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(
            f"{path}: not a `tandem bench serve --save-result` result ({type(e).__name__}: {e})"
        ) from e
    return reqs, {"bench_run": str(path), "num_requests": len(reqs)}


def mixed(
    num_requests: int,
    rate: float,
    long_fraction: float,
    long_len: tuple[int, int],
    short_len: tuple[int, int],
    seed: int = 0,
    priority_by_class: bool = False,
) -> tuple[list[SimRequest], dict]:
    """Poisson arrivals; a long_fraction of long (prompt, output) requests among short ones."""
    if rate <= 0 or not 0 <= long_fraction <= 1:
        raise ValueError("--rate must be positive and --long-fraction in [0, 1]")
    rng, t, reqs = random.Random(seed), 0.0, []
    for i in range(num_requests):
        t += rng.expovariate(rate) if i else 0.0
        long = rng.random() < long_fraction
        p, o = long_len if long else short_len
        prio = CLASS_PRIORITY["long" if long else "short"] if priority_by_class else None
        reqs.append(SimRequest(i, t, p, o, prio, "long" if long else "short"))
    return reqs, {
        "mixed": {
            "num_requests": num_requests,
            "rate": rate,
            "long_fraction": long_fraction,
            "long": long_len,
            "short": short_len,
            "seed": seed,
        }
    }
