"""`tandem plan`: how many prefill and decode instances a traffic needs, co-located or split,
and when an elastic pool should switch roles; every figure printed as checkable arithmetic.
The arithmetic is in sim/planner.py; this file turns a trace into traffic figures and prints."""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import asdict
from pathlib import Path

from tandem.bench.report import parse_goodput
from tandem.sim.cost_model import BatchShape, CostModel
from tandem.sim.hardware import load_cost_model, roofline
from tandem.sim.moe import touched_experts, weight_bytes_read
from tandem.sim.planner import SLO, Plan, Traffic, elastic, plan
from tandem.tools.machine import provenance_lines
from tandem.workload.model_shapes import MODEL_SHAPES

DEFAULT_GOODPUT = ("ttft:1000", "tpot:50")
# A mixture of experts' decode steps shown against the read roofline: batches from one token's
# experts to all of them, at a context short enough for 256 sequences' KV to fit an H100.
MOE_BATCHES, MOE_CONTEXT = (1, 16, 256), 512


def traffic_of(rows: list, rate_scale: float = 1.0, span: float | None = None) -> Traffic:
    """Mean lengths and rate of trace rows (anything with arrival, input_len, output_len);
    the TTFT SLO is judged at the 90th-percentile prompt. rate_scale K: K times the users."""
    if not rows:
        return Traffic(0.0, 0.0, 0.0)
    if span is None:
        span = max(r.arrival for r in rows) - min(r.arrival for r in rows)
    if span <= 0:
        raise ValueError("the trace spans no time: cannot derive a request rate")
    prompts = sorted(r.input_len for r in rows)
    return Traffic(
        len(rows) / span * rate_scale,
        sum(prompts) / len(rows),
        sum(r.output_len for r in rows) / len(rows),
        prompts[int(0.9 * (len(rows) - 1))],
    )


def bucket_traffic(
    rows: list, bucket_seconds: float, rate_scale: float = 1.0
) -> list[tuple[float, Traffic]]:
    """The trace cut into buckets of `bucket_seconds` (the last one as long as the trace runs)."""
    if bucket_seconds <= 0:
        raise ValueError("--bucket-minutes must be positive")
    end = max(r.arrival for r in rows)
    n = max(1, math.ceil(end / bucket_seconds))
    groups: list[list] = [[] for _ in range(n)]
    for r in rows:
        groups[min(int(r.arrival // bucket_seconds), n - 1)].append(r)
    return [
        (
            i * bucket_seconds,
            traffic_of(g, rate_scale, span=max(min(bucket_seconds, end - i * bucket_seconds), 1.0)),
        )
        for i, g in enumerate(groups)
    ]


def add_arguments(p: argparse.ArgumentParser) -> None:
    t = p.add_argument_group("traffic: a trace, or a rate and mean lengths")
    t.add_argument(
        "--trace",
        default=None,
        help="azure | mooncake (the shipped traces) | a path: Azure CSV, "
        "Mooncake JSONL or a tandem request log",
    )
    t.add_argument(
        "--trace-format",
        default="auto",
        help="azure | mooncake | request-log (a tandem request log) | auto: from the file "
        "(default auto)",
    )
    t.add_argument("--strict", action="store_true", help="a malformed trace line is an error")
    t.add_argument("--rate", type=float, default=None, help="requests/s")
    t.add_argument("--prompt-mean", type=float, default=None, help="mean prompt tokens")
    t.add_argument("--output-mean", type=float, default=None, help="mean output tokens")
    t.add_argument(
        "--rate-scale", type=float, default=1.0, help="K times the trace's users (rates x K)"
    )
    t.add_argument("--bucket-minutes", type=float, default=60.0, help="elastic schedule resolution")
    c = p.add_argument_group("cost model: a profile, or a roofline")
    c.add_argument(
        "--profile",
        default=None,
        help="profile JSON from tandem profile, or accelerator:model-shape for a roofline "
        "(h100:llama-3-8b, h100:qwen3-30b-a3b)",
    )
    c.add_argument("--roofline", default=None, help="accelerator: h100, h200, a100-80gb")
    c.add_argument(
        "--model-shape", default=None, help="with --roofline: llama-3-8b, llama-3-70b, ..."
    )
    c.add_argument("--tp", type=int, default=1, help="with --roofline: devices per instance")
    c.add_argument("--interconnect", default="nvlink", help="with --roofline: nvlink | rdma | pcie")
    s = p.add_argument_group("service level objectives")
    s.add_argument(
        "--goodput",
        nargs="+",
        default=None,
        metavar="KEY:MS",
        help="SLOs in milliseconds, vLLM's syntax: ttft (to the first token) and tpot (between "
        f"tokens); default {' '.join(DEFAULT_GOODPUT)}",
    )
    s.add_argument(
        "--utilization", type=float, default=0.75, help="target load per instance (headroom)"
    )
    p.add_argument("--json", dest="json_path", default=None, help="write every figure here")


def _cost_model(args: argparse.Namespace) -> CostModel:
    if bool(args.profile) == bool(args.roofline):
        raise ValueError("give one of --profile PATH or --roofline ACCELERATOR --model-shape NAME")
    if args.profile:
        return load_cost_model(args.profile)
    if not args.model_shape:
        raise ValueError("--roofline needs --model-shape (e.g. llama-3-8b)")
    return roofline(args.roofline, args.model_shape, tp=args.tp, interconnect=args.interconnect)


def _traffic(args: argparse.Namespace) -> tuple[Traffic, list | None, int]:
    """The overall traffic, its buckets (trace only) and the number of malformed lines skipped."""
    if args.rate_scale <= 0:
        raise ValueError("--rate-scale must be positive")
    if bool(args.trace) == (args.rate is not None):
        raise ValueError("give one of --trace PATH or --rate R --prompt-mean P --output-mean O")
    if args.trace:
        from tandem.workload.traces import read_trace, resolve_trace

        rows, skipped = read_trace(resolve_trace(args.trace), args.strict, args.trace_format)
        if len(rows) < 2:
            raise ValueError(
                f"{args.trace}: {len(rows)} usable row(s); need at least two to derive a rate"
            )
        return (
            traffic_of(rows, args.rate_scale),
            bucket_traffic(rows, args.bucket_minutes * 60, args.rate_scale),
            len(skipped),
        )
    if (
        args.rate <= 0
        or not args.prompt_mean
        or not args.output_mean
        or min(args.prompt_mean, args.output_mean) <= 0
    ):
        raise ValueError("--rate, --prompt-mean and --output-mean must all be given and positive")
    return Traffic(args.rate * args.rate_scale, args.prompt_mean, args.output_mean), None, 0


def explain(p: Plan, cm: CostModel) -> list[str]:
    """The plan as arithmetic an operator can check line by line."""
    t, slo, u = p.traffic, p.slo, p.slo.utilization
    pre, dec, co, busy = p.prefill, p.decode, p.colocated, p.colocated_busy
    dp, dd, transfer = p.prefill_demand, p.decode_demand, p.kv_transfer
    ttft_prompt, context = t.ttft_prompt or t.prompt_mean, t.prompt_mean + t.output_mean / 2
    steps = 1 + math.ceil(ttft_prompt / pre.size)
    lines = [
        f"traffic: {t.rate:.3f} req/s, prompt mean {t.prompt_mean:.0f} tok "
        f"(TTFT judged at {ttft_prompt:.0f}), output mean {t.output_mean:.0f} tok; "
        f"SLO TTFT {slo.ttft} s, ITL {slo.itl} s; target utilisation u = {u}",
        f"prefill demand = {t.rate:.3f} req/s x {t.prompt_mean:.0f} tok = {dp:,.0f} tok/s",
        f"decode demand  = {t.rate:.3f} req/s x {t.output_mean:.0f} tok = {dd:,.0f} tok/s",
        f"X (prefill instance): steps of {pre.size} tokens take {pre.step * 1e3:.1f} ms "
        f"-> X = {pre.throughput:,.0f} tok/s; "
        f"TTFT = (1 + ceil({ttft_prompt:.0f}/{pre.size})) x {pre.latency / steps * 1e3:.1f} ms "
        f"(its chunks) + KV transfer {transfer * 1e3:.2f} ms = {pre.latency + transfer:.3f} s "
        f"<= {slo.ttft} s (stopped by {pre.limit})",
        f"Y (decode instance): batch {dec.size} at context {context:.0f} tok "
        f"(KV {dec.size * context:,.0f} of "
        f"{cm.kv_capacity_tokens:,} tokens), step {dec.step * 1e3:.1f} ms <= ITL {slo.itl} s -> "
        f"Y = {dec.throughput:,.0f} tok/s (stopped by {dec.limit})",
        f"P = ceil({dp:,.0f} / ({pre.throughput:,.0f} x {u})) "
        f"= ceil({dp / (pre.throughput * u):.3f}) = {p.num_prefill}",
        f"D = ceil({dd:,.0f} / ({dec.throughput:,.0f} x {u})) "
        f"= ceil({dd / (dec.throughput * u):.3f}) = {p.num_decode}",
    ]
    if co is None:
        lines.append(
            "co-located: no mixed step keeps decodes within the ITL SLO and the prompt within TTFT"
        )
    else:
        lines += [
            f"co-located: each step carries T = {co.prefill_tokens} prompt tokens "
            f"with B = {co.decode_batch} decodes: {co.step * 1e3:.1f} ms <= ITL {slo.itl} s; "
            f"the B decodes alone take {co.decode_only_step * 1e3:.1f} ms, so the chunk adds "
            f"{(co.step - co.decode_only_step) * 1e3:.1f} ms to every ITL (interference); "
            f"TTFT {co.ttft:.3f} s; one instance serves "
            f"min(T/{t.prompt_mean:.0f}, B/{t.output_mean:.0f}) / step = {co.rate:.3f} req/s",
            f"  prefill time = {busy[0]:.3f} s/s + decode time = {busy[1]:.3f} s/s; "
            f"instances = ceil({sum(busy):.3f} / {u}) = {p.num_colocated}",
        ]
    lines.append(f"recommendation: {p.recommendation}")
    return lines


def moe_decode_lines(cm: CostModel) -> list[str]:
    """A mixture of experts' roofline: decode steps against the bytes they read (the dense
    weights, the experts their tokens touch, the KV) over the accelerator's peak bandwidth."""
    shape = MODEL_SHAPES.get(cm.info.get("model_shape", ""))
    if shape is None or not shape.num_experts:
        return []
    peak = cm.info["accelerator"]["hbm_bandwidth"] * cm.info["tensor_parallel"]
    lines = [
        f"decode at context {MOE_CONTEXT} against the read roofline (bytes read / "
        f"{peak / 1e12:.2f} TB/s peak): {shape.active_params / 1e9:.2f}B of "
        f"{shape.num_params / 1e9:.2f}B parameters active per token"
    ]
    for b in MOE_BATCHES:
        weights = weight_bytes_read(shape, b, cm.info["dtype_bytes"])
        kv = b * (MOE_CONTEXT + 1) * cm.kv_bytes_per_token
        step = cm.step_time(BatchShape(num_decode_seqs=b, decode_context=b * MOE_CONTEXT))
        touched = touched_experts(shape.num_experts, shape.num_experts_per_tok, b)
        lines.append(
            f"  batch {b:>3}: {touched:5.1f} of {shape.num_experts} experts per layer, "
            f"reads {weights / 1e9:5.2f} GB of weights + {kv / 1e9:5.2f} GB of KV; "
            f"step {step * 1e3:5.2f} ms, roofline {(weights + kv) / peak * 1e3:5.2f} ms "
            f"({(weights + kv) / peak / step:.0%} of the step); {b / step:,.0f} tok/s"
        )
    return lines


def _slo_seconds(args: argparse.Namespace) -> tuple[float, float]:
    """(TTFT, ITL) in seconds: --goodput over its defaults."""
    slo = {**parse_goodput(DEFAULT_GOODPUT), **parse_goodput(args.goodput)}
    if "e2e" in slo:
        raise ValueError(
            "--goodput: plan sizes instances by ttft and tpot; e2el is not one of its SLOs"
        )
    return slo["ttft"], slo["tpot"]


def _clock(seconds: float) -> str:
    return f"{int(seconds // 3600):02d}:{int(seconds % 3600 // 60):02d}"


def main(args: argparse.Namespace) -> dict:
    cm = _cost_model(args)
    traffic, buckets, skipped = _traffic(args)
    slo = SLO(*_slo_seconds(args), args.utilization)
    result = plan(cm, traffic, slo)
    print(
        f"cost model: {cm.describe()}"
        + (f"; trace {args.trace} ({skipped} malformed lines skipped)" if args.trace else "")
        + (f"; rates x {args.rate_scale}" if args.rate_scale != 1 else "")
    )
    print("\n".join(provenance_lines(cm.info, cm.kind) + moe_decode_lines(cm)))
    print("\n".join(explain(result, cm)))
    print(
        f"=> disaggregated P = {result.num_prefill}, D = {result.num_decode}; "
        f"co-located {result.num_colocated}"
    )
    report = {
        "cost_model": {k: v for k, v in cm.to_json().items() if k != "info"}
        | {"describe": cm.describe()},
        "plan": asdict(result),
    }
    if buckets:
        el = elastic(cm, buckets, slo, args.bucket_minutes * 60)
        print(
            f"\nelastic schedule, buckets of {args.bucket_minutes:g} min "
            "(same SLOs and headroom per bucket):"
        )
        print(f"  {'start':>5} {'req/s':>8} {'prompt':>7} {'output':>7} {'P':>4} {'D':>4}")
        for b in el.buckets:
            print(
                f"  {_clock(b['start']):>5} {b['rate']:>8.2f} {b['prompt_mean']:>7.0f} "
                f"{b['output_mean']:>7.0f} "
                + (
                    f"{b['P']:>4} {b['D']:>4}"
                    if b["P"] is not None
                    else f"  SLOs unmet: {b['error']}"
                )
            )
        print(
            f"  pool: {el.total} instances = {el.fixed_prefill} always prefill "
            f"+ {el.fixed_decode} always decode "
            f"+ {el.elastic} elastic"
        )
        for s in el.switches or [{"start": None}]:
            print(
                "  no switch needed: the split holds all trace long"
                if s["start"] is None
                else f"  switch at {_clock(s['start'])}: P {s['P'][0]} -> {s['P'][1]}, "
                f"D {s['D'][0]} -> {s['D'][1]}"
            )
        if len(el.buckets) == 1:
            print(
                "  (the trace fits one bucket: "
                "a smaller --bucket-minutes shows how the split moves)"
            )
        report["elastic"] = asdict(el)
    if args.json_path:
        Path(args.json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_path).write_text(json.dumps(report, indent=1) + "\n")
        print(f"wrote {args.json_path}")
    return report
