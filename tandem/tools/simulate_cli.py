"""`tandem simulate`: replay a workload on a simulated cluster (the real scheduler, KV pool and
cluster policies over a cost model) and report what `tandem bench serve` reports, for one
configuration or a grid of instance counts, modes and scheduling policies."""

from __future__ import annotations

import argparse
import json
import sys
import time

from tqdm import tqdm

from tandem.bench.report import fmt, jsonable, parse_goodput, summarize, table
from tandem.cluster.policy.elastic import ElasticConfig, TimeSchedule
from tandem.cluster.policy.routing import RoutingWeights
from tandem.config import EngineConfig, load_yaml
from tandem.config.args import add_engine_arguments, given
from tandem.sim import workload
from tandem.sim.cluster import MODES, ClusterConfig, ClusterSim
from tandem.sim.hardware import load_cost_model
from tandem.sim.prefix_report import prefix_figures
from tandem.tools.machine import provenance_lines

ENGINE_OPTIONS = (
    "max_num_seqs",
    "max_num_batched_tokens",
    "max_model_len",
    "l2_min_share",
    "l1_step_time",
    "enable_prefix_caching",
)
# An instance stands for a GPU server (the profiles' accelerators): vLLM's 256 seats, not the
# CPU engine's 128.
ENGINE_DEFAULTS = {"max_num_seqs": 256}


def add_arguments(p: argparse.ArgumentParser) -> None:
    src = p.add_mutually_exclusive_group()
    src.add_argument(
        "--trace", default="azure", help="azure | mooncake | a trace path (CSV, JSONL, request log)"
    )
    src.add_argument(
        "--replay",
        metavar="BENCH_JSON",
        help="the exact requests of a `tandem bench serve --save-result` run",
    )
    src.add_argument(
        "--mixed", action="store_true", help="synthetic long + short mix (see --long-*, --short-*)"
    )
    g = p.add_argument_group("trace window")
    g.add_argument(
        "--window-start",
        type=float,
        default=0.0,
        help="seconds into the trace where the window starts (default 0)",
    )
    g.add_argument(
        "--window-seconds",
        type=float,
        default=None,
        help="seconds of the trace simulated (default: to its end)",
    )
    g.add_argument(
        "--max-requests",
        type=int,
        default=None,
        help="requests of the window simulated at most (default: all)",
    )
    g.add_argument(
        "--time-scale", type=float, default=1.0, help="multiply arrival gaps (0.5 = twice the rate)"
    )
    g.add_argument(
        "--length-scale",
        type=float,
        default=1.0,
        help="multiply prompt and output lengths (default 1)",
    )
    g.add_argument(
        "--strict", action="store_true", help="reject a malformed trace line instead of skipping it"
    )
    g.add_argument(
        "--rate-per-instance",
        type=float,
        default=None,
        help="rescale arrivals to this many requests/s per instance (trace or mixed), so every "
        "cluster size sees the same load per instance",
    )
    g = p.add_argument_group("mixed workload")
    g.add_argument(
        "--num-prompts", dest="num_requests", type=int, default=2000, help="requests (default 2000)"
    )
    g.add_argument("--rate", type=float, default=20.0, help="requests/s (Poisson)")
    g.add_argument(
        "--long-fraction", type=float, default=0.05, help="share of long requests (default 0.05)"
    )
    g.add_argument(
        "--long",
        type=int,
        nargs=2,
        default=(8000, 256),
        metavar=("PROMPT", "OUTPUT"),
        help="tokens of a long request's prompt and output (default 8000 256)",
    )
    g.add_argument(
        "--short",
        type=int,
        nargs=2,
        default=(30, 30),
        metavar=("PROMPT", "OUTPUT"),
        help="tokens of a short request's prompt and output (default 30 30)",
    )
    g.add_argument(
        "--priority-by-class", action="store_true", help="short -> L1, long -> L2 (else by length)"
    )
    g.add_argument("--seed", type=int, default=0, help="seed of the mixed workload (default 0)")
    g = p.add_argument_group("cluster")
    g.add_argument(
        "--profile",
        default="h100:llama-3-8b",
        help="a profile JSON from `tandem profile`, or accelerator:model-shape for a "
        "roofline; its step size is the instances' max_num_batched_tokens unless "
        "given",
    )
    g.add_argument(
        "--step-scale",
        type=float,
        default=1.0,
        help="multiply every step time (serving overhead over the profiled executor, "
        "calibrated from a served run of another workload)",
    )
    g.add_argument(
        "--step-overhead-ms",
        type=float,
        default=0.0,
        help="add to every step time (calibrated like --step-scale)",
    )
    g.add_argument(
        "--frontend-ms",
        type=float,
        default=0.0,
        help="client send -> engine queue per request (HTTP, tokenising), counted in TTFT and E2E",
    )
    g.add_argument("--instances", default="1", help="comma list, e.g. 8,16,32")
    g.add_argument("--mode", default="colocated", help=f"comma list of {', '.join(MODES)}")
    g.add_argument(
        "--prefill",
        type=int,
        default=None,
        help="P/D prefill instances at the start "
        "(default: pd searches for the best by goodput; elastic starts at N/2)",
    )
    g.add_argument("--policy", default="fcfs", help="comma list of fcfs, multilevel")
    g.add_argument(
        "--elastic-schedule", default=None, help='time schedule "HH:P,HH:P", e.g. "8:2,20:4"'
    )
    g.add_argument(
        "--elastic-cooldown", type=float, default=10.0, help="seconds between two role switches"
    )
    g.add_argument(
        "--no-coalesce", action="store_true", help="step every decode step (slower; same results)"
    )
    g.add_argument(
        "--prefix-weight",
        type=float,
        default=RoutingWeights().prefix,
        help="routing score of a full prefix-cache hit against load (router.weights.prefix); "
        "0: by load alone",
    )
    g = p.add_argument_group("engine (each instance)")
    g.add_argument(
        "--config",
        default=None,
        help="serving YAML (its engine/cache/scheduler sections; the flags below override it)",
    )
    add_engine_arguments(p, ENGINE_OPTIONS, defaults=ENGINE_DEFAULTS)
    p.add_argument(
        "--goodput",
        nargs="+",
        default=["ttft:2000", "tpot:100"],
        metavar="KEY:MS",
        help="goodput SLOs in milliseconds, vLLM's syntax: ttft, tpot, e2el "
        "(default ttft:2000 tpot:100)",
    )
    p.add_argument(
        "--json",
        dest="json_path",
        default=None,
        help="also write every figure as JSON to this path",
    )


def _requests(args, instances: int = 1):
    if args.replay:
        reqs, desc = workload.from_bench_run(args.replay)
    elif args.mixed:
        rate = args.rate_per_instance * instances if args.rate_per_instance else args.rate
        reqs, desc = workload.mixed(
            args.num_requests,
            rate,
            args.long_fraction,
            tuple(args.long),
            tuple(args.short),
            args.seed,
            args.priority_by_class,
        )
    else:
        reqs, desc = workload.from_trace(
            args.trace,
            args.window_start,
            args.window_seconds,
            args.max_requests,
            args.time_scale,
            args.length_scale,
            args.strict,
        )
    if args.rate_per_instance and not args.mixed:
        if args.rate_per_instance <= 0:
            raise ValueError("--rate-per-instance must be positive")
        span = max(r.arrival for r in reqs) or 1.0
        scale = (len(reqs) / span) / (args.rate_per_instance * instances)
        for r in reqs:
            r.arrival *= scale
        desc["rate_per_instance"] = args.rate_per_instance
    return reqs, desc


def _yaml_engine(path: str | None) -> dict:
    """The serving YAML's engine options the simulator honours. Speculative decoding is not
    simulated (the simulated executor proposes no drafts, and the cost model has no verify or
    draft step): it is refused in words, and the run simulates without it."""
    values = load_yaml(path, "engine") if path else {}
    if values.pop("speculative_config", None) is not None:
        print(
            f"tandem simulate: {path}: serving.speculative_decoding is not simulated "
            "(the simulated executor proposes no drafts); simulating without speculation",
            file=sys.stderr,
        )
    return values


def _engine(args, cost, policy: str, yaml_values: dict) -> EngineConfig:
    values = {
        **ENGINE_DEFAULTS,
        "max_num_batched_tokens": cost.max_num_batched_tokens,
        **yaml_values,
        **given(args, ENGINE_OPTIONS),
    }
    return EngineConfig.from_kwargs(**{**values, "scheduling_policy": policy})


def _schedule(text: str | None) -> TimeSchedule | None:
    if not text:
        return None
    try:
        return TimeSchedule(
            tuple((float(h) * 3600, int(n)) for h, n in (e.split(":") for e in text.split(",")))
        )
    except ValueError:
        raise ValueError(
            f"--elastic-schedule: expected HH:P pairs like 8:2,20:4, got {text!r}"
        ) from None


def run_one(args, cost, engine: EngineConfig, n: int, mode: str, prefill: int, slo: dict) -> dict:
    reqs, _ = _requests(args, n)
    cfg = ClusterConfig(
        n,
        mode,
        prefill,
        elastic=ElasticConfig(cooldown_s=args.elastic_cooldown),
        schedule=_schedule(args.elastic_schedule),
        controller_interval=1.0,
        coalesce=not args.no_coalesce,
        frontend_delay=args.frontend_ms / 1000,
        weights=RoutingWeights(prefix=args.prefix_weight),
    )
    sim = ClusterSim(cost, engine, cfg)
    t0 = time.perf_counter()
    sim.run(reqs)
    wall = time.perf_counter() - t0
    caching = engine.cache_config.enable_prefix_caching
    prefix = prefix_figures(sim, reqs) if mode == "colocated" and caching else None
    span = max((r.finished or r.arrival) for r in reqs)
    summary = summarize([r.record() for r in reqs], span, slo)
    classes = sorted({r.cls for r in reqs})
    busy = sum(i.busy_time for i in sim.instances)
    return {
        "instances": n,
        "mode": mode,
        "prefill": prefill if mode != "colocated" else None,
        "policy": engine.scheduler_config.scheduling_policy,
        "summary": summary,
        "per_class": {
            c: summarize([r.record() for r in reqs if r.cls == c], span, slo) for c in classes
        }
        if len(classes) > 1
        else {},
        "kv_usage_mean": sum(i.usage_time for i in sim.instances) / max(busy, 1e-12),
        "kv_usage_peak": max(i.usage_peak for i in sim.instances),
        "busy_share": busy / (n * span) if span else 0.0,
        "steps": sum(i.num_steps for i in sim.instances),
        "coalesced_steps": sum(i.num_coalesced for i in sim.instances),
        "transfer_gb": sim.transfer_bytes / 1e9,
        "role_switches": sim.role_switches,
        "sim_wall_s": wall,
        "prefix_cache": prefix,
    }


def _rank(r: dict) -> tuple[float, float]:
    """Share of requests within the SLOs, then the lower E2E p90 (ties are common when every
    split meets the SLOs)."""
    s = r["summary"]
    return (s["goodput"]["share"] if s["goodput"] else 0.0, -(s["e2e_ms"]["p90"] or float("inf")))


def _search_pd(args, cost, engine, n: int, mode: str, slo: dict, bar) -> tuple[dict, list[dict]]:
    """Best initial prefill count by goodput (see _rank): a coarse grid over P/N, then the best
    one's neighbours."""
    tried: dict[int, dict] = {}

    def run(p: int) -> None:
        if 1 <= p < n and p not in tried:
            tried[p] = run_one(args, cost, engine, n, mode, p, slo)
            bar.update(1)

    for f in (0.25, 0.375, 0.5, 0.625):
        run(max(1, min(n - 1, round(n * f))))
    best = max(tried, key=lambda p: _rank(tried[p]))
    for d in (-1, 1):
        run(best + d)
    best = max(tried, key=lambda p: _rank(tried[p]))
    return tried[best], [tried[p] for p in sorted(tried)]


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


def main(args: argparse.Namespace) -> dict:
    slo = parse_goodput(args.goodput)
    if args.frontend_ms < 0 or args.prefix_weight < 0:
        raise ValueError("--frontend-ms and --prefix-weight must be >= 0")
    cost = load_cost_model(args.profile)
    if args.step_scale != 1.0 or args.step_overhead_ms:
        cost = cost.calibrated(args.step_scale, args.step_overhead_ms / 1000)
    _, desc = _requests(args)  # validates the workload before any run
    yaml_values = _yaml_engine(args.config)
    grid = [
        (int(n), m.strip(), pol.strip())
        for n in args.instances.split(",")
        for m in args.mode.split(",")
        for pol in args.policy.split(",")
    ]
    for n, m, _ in grid:
        if m not in MODES or n < 1 or (m != "colocated" and n < 2):
            raise ValueError(
                f"bad configuration: {n} instances in mode {m!r} (P/D needs at least 2)"
            )
    print(f"workload: {json.dumps(desc)[:400]}\ncost model: {args.profile} ({cost.kind})")
    print("\n".join(provenance_lines(cost.info, cost.kind)))
    results, searched = [], []
    with tqdm(desc="simulate", unit="run", disable=None) as bar:
        for n, mode, policy in grid:
            engine = _engine(args, cost, policy, yaml_values)
            if mode != "pd" or args.prefill is not None:  # elastic finds its own split from P = N/2
                results.append(
                    run_one(args, cost, engine, n, mode, args.prefill or max(1, n // 2), slo)
                )
                bar.update(1)
            else:
                best, tried = _search_pd(args, cost, engine, n, mode, slo, bar)
                results.append(best)
                searched += tried
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
    out = {
        "workload": desc,
        "profile": args.profile,
        "slo": slo,
        "results": results,
        "pd_search": searched,
    }
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump(jsonable(out), f, indent=1)
    return out
