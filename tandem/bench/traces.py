"""Trace replay for `tandem bench serve`: a window of a parsed trace, scaled in time and length,
as requests; Mooncake prompts share real token prefixes wherever their hash ids agree."""

from __future__ import annotations

import random

from tandem.bench.workloads import PromptSynth, Request
from tandem.workload.traces import (
    MOONCAKE_BLOCK_TOKENS,
    read_azure,
    read_mooncake,
    resolve_trace,
    select,
)


def _scaled(n: int, scale: float, cap: int | None) -> int:
    n = max(1, round(n * scale))
    return min(n, cap) if cap else n


def trace_workload(args, synth: PromptSynth) -> tuple[list[Request], dict]:
    kind = args.dataset_name
    path = resolve_trace(args.trace or kind)
    if args.length_scale <= 0:
        raise ValueError("--length-scale must be positive")
    rows, skipped = (read_azure if kind == "azure" else read_mooncake)(path, args.strict)
    picked = select(
        rows, args.window_start, args.window_seconds, args.max_requests, args.time_scale
    )
    if not picked:
        raise ValueError(f"{path}: no requests in the selected window ({len(rows)} rows parsed)")
    block = max(1, round(MOONCAKE_BLOCK_TOKENS * args.length_scale))
    blocks: dict[int, list[int]] = {}
    reqs, capped_in, capped_out = [], 0, 0
    for i, r in enumerate(picked):
        rng = random.Random(f"{args.seed}:request:{i}")
        inp = _scaled(r.input_len, args.length_scale, args.max_input_len)
        out = _scaled(r.output_len, args.length_scale, args.max_output_len)
        capped_in += inp < max(1, round(r.input_len * args.length_scale))
        capped_out += out < max(1, round(r.output_len * args.length_scale))
        ids: list[int] = []
        used = 0
        for h in r.hash_ids:  # each hash id is its own fixed block of exactly `block` tokens
            if len(ids) >= inp:
                break
            if h not in blocks:
                blocks[h] = synth.words(random.Random(f"{args.seed}:block:{h}"), block)
            ids += blocks[h]
            used += 1
        text, got = synth.fit(ids, inp, rng)
        shared = tuple(r.hash_ids[:used])
        reqs.append(Request(i, text, got, out, r.arrival, hash_ids=shared, block_tokens=block))
    span = picked[-1].arrival
    scaling = {
        "window_start_s": args.window_start,
        "window_seconds": args.window_seconds,
        "max_requests": args.max_requests,
        "time_scale": args.time_scale,
        "length_scale": args.length_scale,
        "max_input_len": args.max_input_len,
        "max_output_len": args.max_output_len,
        "capped_inputs": capped_in,
        "capped_outputs": capped_out,
    }
    if kind == "mooncake":
        scaling["block_tokens"] = block
    desc = {
        "name": kind,
        "trace": str(path),
        "rows_parsed": len(rows),
        "num_requests": len(reqs),
        "skipped_lines": len(skipped),
        "skipped": skipped[:50],
        "scaling": scaling,
        "trace_input_tokens_mean": sum(r.input_len for r in picked) / len(picked),
        "trace_output_tokens_mean": sum(r.output_len for r in picked) / len(picked),
        "replayed_input_tokens_mean": sum(q.input_len for q in reqs) / len(reqs),
        "replayed_output_tokens_mean": sum(q.output_len for q in reqs) / len(reqs),
        "replay_span_s": span,
        "max_concurrency": args.max_concurrency,
        "description": f"{kind} trace {path.name}: {len(reqs)} requests over {span:.1f}s "
        f"(window start {args.window_start:g}s, "
        f"{'to the end' if args.window_seconds is None else f'{args.window_seconds:g}s'}; "
        f"time x{args.time_scale:g}, lengths x{args.length_scale:g}, "
        f"input cap {args.max_input_len}, output cap {args.max_output_len}"
        + (f", {block}-token prefix blocks" if kind == "mooncake" else "")
        + ")"
        + (f"; {len(skipped)} malformed line(s) skipped" if skipped else ""),
    }
    return reqs, desc
