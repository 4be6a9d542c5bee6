"""`tandem analyze TRACE`: the workload report (lengths, rate, tokens in flight, prefix reuse,
recommendation) printed for a person, and optionally as JSON and PNG plots."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from tandem.workload.analyze import LONG_PROMPT_TOKENS, SHORT_PROMPT_TOKENS, analyze
from tandem.workload.model_shapes import MODEL_SHAPES, get_shape
from tandem.workload.traces import READERS, read_trace, resolve_trace, trace_format

KV_DTYPE_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2, "fp8": 1}
SHOW_SKIPPED = 10


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "trace",
        help="azure | mooncake (the shipped traces) | a path: Azure CSV, Mooncake JSONL, "
        "or the request log of `tandem serve --request-log` (.xz/.gz read compressed)",
    )
    p.add_argument(
        "--format",
        default="auto",
        choices=["auto", *READERS],
        help="trace format (default: detect)",
    )
    p.add_argument(
        "--strict", action="store_true", help="reject a malformed line instead of skipping it"
    )
    p.add_argument(
        "--model-shape",
        default="llama-3-8b",
        help=f"model shape for KV bytes: {', '.join(MODEL_SHAPES)} (default llama-3-8b)",
    )
    p.add_argument(
        "--kv-cache-dtype",
        default="fp16",
        choices=list(KV_DTYPE_BYTES),
        help="KV element type the KV bytes are counted in (default fp16)",
    )
    p.add_argument(
        "--decode-tps",
        type=float,
        default=50.0,
        help="decode tokens/s per request; a request holds its KV for output_tokens / this",
    )
    p.add_argument(
        "--hold-seconds", type=float, default=None, help="hold every request's KV this long instead"
    )
    p.add_argument("--bin-seconds", type=float, default=60.0, help="bin of the requests/s curve")
    p.add_argument(
        "--plot", default=None, metavar="DIR", help="write analyze_<format>_*.png plots here"
    )
    p.add_argument(
        "--json", dest="json_path", default=None, metavar="PATH", help="write every figure as JSON"
    )


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def _print(r: dict) -> None:
    print(
        f"trace {r['trace']} ({r['format']}): {r['requests']:,} requests "
        f"over {r['duration_s'] / 60:.1f} min, "
        f"{len(r['skipped'])} malformed line(s) skipped"
    )
    cols = ("mean", "p50", "p75", "p95", "p99", "max")
    print(
        f"{'':14}" + "".join(f"{c:>8}" for c in cols) + f"{'<' + str(SHORT_PROMPT_TOKENS):>8}"
        f"{'>' + str(LONG_PROMPT_TOKENS):>8}"
    )
    for key in ("prompt_tokens", "output_tokens"):
        s = r[key]
        print(
            f"{key.replace('_', ' '):14}"
            + "".join(f"{s[c]:>8.0f}" for c in cols)
            + f"{s[f'share_under_{SHORT_PROMPT_TOKENS}']:>8.1%}"
            f"{s[f'share_over_{LONG_PROMPT_TOKENS}']:>8.1%}"
        )
    print(f"prompt:output tokens {r['prompt_output_ratio']:.1f}:1")
    rate = r["rate"]
    print(
        f"requests/s per {rate['bin_seconds']:g} s: mean {rate['mean_rps']:.2f}, "
        f"peak {rate['peak_rps']:.2f}, "
        f"trough {rate['trough_rps']:.2f}; busiest second {rate['peak_rps_1s']} requests"
    )
    f = r["in_flight"]
    print(
        f"tokens in flight: peak {f['peak_tokens']:,} ({f['peak_requests']} requests), "
        f"mean {f['mean_tokens']:,.0f}"
    )
    print(
        f"peak KV demand ({f['model']}, {f['dtype_bytes']}-byte KV, "
        f"{f['kv_bytes_per_token'] / 1024:g} KiB/token): "
        f"{_gib(f['peak_kv_bytes'])}; mean {_gib(f['mean_tokens'] * f['kv_bytes_per_token'])}"
    )
    print(f"  assumption: {f['assumption']}")
    if (p := r["prefix_reuse"]) is not None:
        print(
            f"prefix reuse (ideal infinite cache, {p['block_tokens']}-token blocks): "
            f"{p['block_ratio']:.1%} of blocks, {p['token_ratio']:.1%} of prompt tokens; "
            f"{p['requests_with_hit']:.0%} of requests hit"
        )
    rec = r["recommendation"]
    print(f"recommendation: {rec['mode']}")
    for line in rec["reasons"]:
        print(f"  - {line}")
    for line in rec["notes"]:
        print(f"  note: {line}")


def main(args: argparse.Namespace) -> dict:
    path = resolve_trace(args.trace)
    shape = get_shape(args.model_shape)
    kind = trace_format(path) if args.format == "auto" else args.format
    rows, skipped = read_trace(path, args.strict, kind)
    for s in skipped[:SHOW_SKIPPED]:
        print(f"warning: {path}:{s['line']}: {s['error']} (skipped)", file=sys.stderr)
    if len(skipped) > SHOW_SKIPPED:
        print(
            f"warning: {len(skipped) - SHOW_SKIPPED} more malformed line(s) skipped",
            file=sys.stderr,
        )
    if not rows:
        raise ValueError(f"{path}: no valid requests ({len(skipped)} malformed line(s))")
    report = {
        "trace": str(path),
        "format": kind,
        "skipped": skipped,
        **analyze(
            rows,
            shape,
            KV_DTYPE_BYTES[args.kv_cache_dtype],
            args.decode_tps,
            args.hold_seconds,
            args.bin_seconds,
        ),
    }
    _print(report)
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(report, indent=1))
    if args.plot:
        from tandem.workload.plots import write_plots

        prompts, outputs = (
            np.array([r.input_len for r in rows]),
            np.array([r.output_len for r in rows]),
        )
        for p in write_plots(
            report, prompts, outputs, Path(args.plot), f"analyze_{kind.replace('-', '_')}_"
        ):
            print(f"wrote {p}")
    return report
