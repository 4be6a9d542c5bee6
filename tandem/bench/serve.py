"""`tandem bench serve`: a token-level load tester for any OpenAI-compatible endpoint.

Builds a workload (random, mixed, or a replayed Azure / Mooncake trace) of prompts with exact
token counts, sends it on its arrival schedule as streaming requests, measures TTFT, ITL,
TPOT and E2E per request from the SSE stream, and reports percentiles, throughput, SLO
goodput and (when the server sends a `metrics` object) the queue / prefill / decode split.
The server's own counters (`/metrics` before and after: prefix-cache hit ratio, preemptions,
P/D transfers) are reported for the run. `--compare URL2` replays the same requests and
schedule against a second server."""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import math
import time
from pathlib import Path

from tandem.bench import report, report_plots, report_tables
from tandem.bench.endpoint_request import run_requests
from tandem.bench.scrape import (
    format_counters,
    format_ideal,
    ideal_of,
    kv_layout,
    run_counters,
    scrape,
    warm_mismatch,
)
from tandem.bench.serve_args import (
    add_report_arguments,
    add_target_arguments,
    add_trace_arguments,
    add_workload_arguments,
)
from tandem.bench.workloads import PromptSynth, Request, mixed_workload, random_workload
from tandem.workload.traces import SHIPPED_TRACES, resolve_trace, trace_format

FALLBACK_TOKENIZER = "smollm2-135m"


@functools.lru_cache(maxsize=4)
def _tokenizer(name: str | None, model: str):
    """--tokenizer, else the --model value when it resolves locally, else smollm2-135m."""
    from tandem.models.loader.model_files import load_tokenizer, resolve_model

    if name is None:
        try:
            folder, name = resolve_model(model), model
        except (FileNotFoundError, ValueError, OSError):
            folder, name = resolve_model(FALLBACK_TOKENIZER), FALLBACK_TOKENIZER
    else:
        folder = resolve_model(name)
    tok = load_tokenizer(folder)
    if tok is None:
        raise ValueError(f"model {name!r} ships no tokenizer; pass --tokenizer")
    return name, tok


def prefix_ideal(args, requests: list[Request], url: str) -> dict | None:
    """The ideal hit ratio of these prompts at the server's block size (completions only: the
    chat template adds tokens the ideal would not see)."""
    layout = kv_layout(url, args.api_key) if args.endpoint == "completions" else None
    if layout is None:
        return None
    _, tok = _tokenizer(args.tokenizer, args.model)
    return ideal_of(
        [tok.encode(r.prompt) for r in sorted(requests, key=lambda r: r.arrival)], *layout
    )


def dataset_of(args) -> str:
    """--dataset-name, else the format of the --trace file, else random; a --trace with a
    dataset that is not that trace's format is refused."""
    name = args.dataset_name
    if args.trace is None:
        return name or "random"
    kind = trace_format(resolve_trace(args.trace))
    if kind not in SHIPPED_TRACES:
        raise ValueError(
            f"--trace {args.trace} is a {kind}; "
            f"bench serve replays {' and '.join(SHIPPED_TRACES)} traces"
        )
    if name not in (None, kind):
        raise ValueError(
            f"--trace {args.trace} is a {kind} trace but --dataset-name is {name}; "
            f"drop --dataset-name or give --dataset-name {kind}"
        )
    return kind


def build_workload(args) -> tuple[list[Request], dict]:
    args.dataset_name = dataset_of(args)
    tok_name, tok = _tokenizer(args.tokenizer, args.model)
    synth = PromptSynth(tok)
    if args.dataset_name in SHIPPED_TRACES:
        from tandem.bench.traces import trace_workload

        requests, desc = trace_workload(args, synth)
    else:
        requests, desc = (mixed_workload if args.dataset_name == "mixed" else random_workload)(
            args, synth
        )
    desc["tokenizer"] = tok_name
    if args.tokenizer is None and tok_name != args.model:
        desc["tokenizer_note"] = (
            f" (--model {args.model!r} is not a local model; pass --tokenizer to match it)"
        )
    desc["prompt_tokens"] = synth.report()
    if args.endpoint == "chat":
        desc["prompt_tokens"]["note"] = (
            "counts are of the user message; the chat template adds tokens"
        )
    return requests, desc


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_target_arguments(p)
    add_workload_arguments(p)
    add_trace_arguments(p)
    add_report_arguments(p)


def _report_options(args) -> tuple[tuple[str, ...], tuple[float, ...]]:
    """--percentile-metrics and --metric-percentiles, checked."""
    metrics = tuple(m.strip() for m in args.percentile_metrics.split(",") if m.strip())
    if not metrics or set(metrics) - set(report.METRICS):
        raise ValueError(
            f"--percentile-metrics: {args.percentile_metrics!r}; "
            f"give some of {', '.join(report.METRICS)}"
        )
    try:
        pcts = tuple(float(p) for p in args.metric_percentiles.split(","))
    except ValueError:
        pcts = ()
    if not pcts or not all(0 < p <= 100 for p in pcts):
        raise ValueError(
            f"--metric-percentiles: {args.metric_percentiles!r}; "
            "give e.g. 50,90,99 (each in (0, 100])"
        )
    return metrics, pcts


def result_path(args) -> Path | None:
    """Where the result JSON goes: --save-result into --result-dir."""
    if not args.save_result:
        if args.result_dir or args.result_filename:
            raise ValueError("--result-dir / --result-filename need --save-result")
        return None
    rate = "inf" if math.isinf(args.request_rate) else f"{args.request_rate:g}"
    name = args.result_filename or (
        f"tandem-{args.dataset_name or 'random'}-{rate}qps-"
        f"{args.max_concurrency or 'all'}conc-{time.strftime('%Y%m%d-%H%M%S')}.json"
    )
    return Path(args.result_dir or ".") / name


def main(args: argparse.Namespace) -> dict:
    slo = report.parse_goodput(args.goodput)
    metrics, shown = _report_options(args)
    pcts = tuple(sorted(set(report.PCTS) | set(shown)))
    save = result_path(args)
    if args.num_prompts < 0 or (args.max_concurrency is not None and args.max_concurrency < 1):
        raise ValueError("--num-prompts must be >= 0 and --max-concurrency >= 1")
    requests, workload = build_workload(args)
    urls = [args.base_url] + ([args.compare] if args.compare else [])
    runs = []
    for url in urls:
        before = scrape(url, args.api_key)
        results, duration = asyncio.run(run_requests(args, url.rstrip("/"), requests))
        runs.append(report.build_run(url, results, duration, slo, pcts))
        runs[-1]["server_counters"] = run_counters(before, scrape(url, args.api_key))
        runs[-1]["prefix_ideal"] = prefix_ideal(args, requests, url)
    out = {
        "config": {k: v for k, v in vars(args).items() if k not in ("func",)},
        "workload": workload,
        "results": runs[0],
    }
    print(report_tables.format_run(runs[0], workload, metrics, shown))
    for run in runs:
        print(f"{run['base_url']}: {format_counters(run['server_counters'])}")
        if run["prefix_ideal"]:
            print(f"{run['base_url']}: {format_ideal(run['server_counters'], run['prefix_ideal'])}")
    if len(runs) == 2:
        out["compare"], out["ratios"] = (
            runs[1],
            report.ratios(report.with_classes(runs[0]), report.with_classes(runs[1])),
        )
        warning = warm_mismatch([run["server_counters"] for run in runs])
        if warning:
            print(warning)
        print(report_tables.format_compare(runs[0], runs[1], out["ratios"]))
    if args.plot_dir:
        out["plots"] = report_plots.write_plots(Path(args.plot_dir), runs)
    if save:
        save.parent.mkdir(parents=True, exist_ok=True)
        save.write_text(json.dumps(report.jsonable(out), indent=2))
        print(f"wrote {save}")
    return out
