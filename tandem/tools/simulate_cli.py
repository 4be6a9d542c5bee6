"""`tandem simulate`: replay a workload on a simulated cluster (the real scheduler, KV pool and
cluster policies over a cost model) and report what `tandem bench serve` reports, for one
configuration or a grid of instance counts, modes and scheduling policies."""

from __future__ import annotations

import argparse
import json
import sys
import time

from tqdm import tqdm

from tandem.bench.report import jsonable, parse_goodput, summarize
from tandem.cluster.policy.elastic import ElasticConfig, TimeSchedule
from tandem.cluster.policy.routing import RoutingWeights
from tandem.config import EngineConfig, load_yaml
from tandem.config.args import given
from tandem.config.engine import OPTIONS
from tandem.sim import workload
from tandem.sim.cluster import MODES, ClusterConfig, ClusterSim
from tandem.sim.hardware import load_cost_model
from tandem.sim.prefix_report import prefix_figures
from tandem.tools.machine import provenance_lines
from tandem.tools.simulate_args import (
    ENGINE_DEFAULTS,
    ENGINE_OPTIONS,
    SIMULATED,
    add_cluster_arguments,
    add_instance_arguments,
    add_report_arguments,
    add_workload_arguments,
)
from tandem.tools.simulate_report import print_report


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_workload_arguments(p)
    add_cluster_arguments(p)
    add_instance_arguments(p)
    add_report_arguments(p)


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
    """The serving YAML's engine options. Speculative decoding is not simulated (the simulated
    executor proposes no drafts, and the cost model has no verify or draft step): it is refused
    in words, and the run simulates without it. The other options the instances do not model
    are named in words too."""
    values = load_yaml(path, "engine") if path else {}
    if values.pop("speculative_config", None) is not None:
        print(
            f"tandem simulate: {path}: serving.speculative_decoding is not simulated "
            "(the simulated executor proposes no drafts); simulating without speculation",
            file=sys.stderr,
        )
    ignored = sorted(values.keys() & OPTIONS.keys() - set(SIMULATED))
    if ignored:
        print(
            f"tandem simulate: {path}: {', '.join(ignored)}: not simulated (the profile stands "
            "for the model, its dtype and its KV pool); ignored",
            file=sys.stderr,
        )
    return values


def _engine(args, cost, policy: str | None, yaml_values: dict) -> EngineConfig:
    """`policy` None: the YAML's, else the engine's default."""
    values = {
        **ENGINE_DEFAULTS,
        "max_num_batched_tokens": cost.max_num_batched_tokens,
        **yaml_values,
        **given(args, ENGINE_OPTIONS),
        **({"scheduling_policy": policy} if policy else {}),
    }
    return EngineConfig.from_kwargs(**values)


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


def main(args: argparse.Namespace) -> dict:
    slo = parse_goodput(args.goodput)
    if args.frontend_ms < 0 or args.prefix_weight < 0:
        raise ValueError("--frontend-ms and --prefix-weight must be >= 0")
    cost = load_cost_model(args.profile)
    if args.step_scale != 1.0 or args.step_overhead_ms or args.seq_overhead_ms:
        cost = cost.calibrated(
            args.step_scale, args.step_overhead_ms / 1000, args.seq_overhead_ms / 1000
        )
    _, desc = _requests(args)  # validates the workload before any run
    yaml_values = _yaml_engine(args.config)
    policies = [p.strip() for p in args.policy.split(",")] if args.policy else [None]
    grid = [
        (int(n), m.strip(), policy)
        for n in args.instances.split(",")
        for m in args.mode.split(",")
        for policy in policies
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
    print_report(results, searched)
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
