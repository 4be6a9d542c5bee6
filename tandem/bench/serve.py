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

from tandem.bench import report
from tandem.bench.scrape import (
    format_counters,
    format_ideal,
    ideal_of,
    kv_layout,
    run_counters,
    scrape,
    warm_mismatch,
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


def _body(args, req: Request) -> dict:
    body = {
        "model": args.model,
        "max_tokens": req.output_len,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if args.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": req.prompt}]
    else:
        body["prompt"] = req.prompt
    if req.priority is not None:
        body["priority"] = req.priority
    return body


async def _stream(
    client, path: str, body: dict, headers: dict, chat: bool, out: dict, t0: float
) -> None:
    """POST one streaming request and fill `out` (times are seconds after t0)."""
    async with client.stream("POST", path, json=body, headers=headers) as resp:
        out["status"] = resp.status_code
        if resp.status_code != 200:
            text = (await resp.aread()).decode(errors="replace")
            out["error"] = f"HTTP {resp.status_code}: {text[:500]}"
            return
        async for line in resp.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                out["done"] = True
                return
            chunk = json.loads(data)
            now = time.perf_counter() - t0
            if "error" in chunk:
                out["error"] = f"stream error: {json.dumps(chunk['error'])[:500]}"
                return
            for choice in chunk.get("choices") or []:
                text = (choice.get("delta") or {}).get("content") if chat else choice.get("text")
                if text:
                    out["chunks"].append(now)
                    break
            if chunk.get("usage"):
                out["usage"] = chunk["usage"]
            if isinstance(chunk.get("metrics"), dict):
                out["metrics"] = chunk["metrics"]


async def _one(client, args, req: Request, t0: float, sem, bar) -> dict:
    path = "/v1/chat/completions" if args.endpoint == "chat" else "/v1/completions"
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    out = {"chunks": [], "usage": None, "metrics": None, "status": None, "error": "", "done": False}
    async with sem:
        start = time.perf_counter() - t0
        try:
            await asyncio.wait_for(
                _stream(client, path, _body(args, req), headers, args.endpoint == "chat", out, t0),
                args.request_timeout,
            )
        except (asyncio.TimeoutError, TimeoutError):
            out["error"] = f"timeout after {args.request_timeout:g}s"
        except Exception as e:  # noqa: BLE001 - any transport or protocol failure is a failed request
            out["error"] = f"{type(e).__name__}: {e}"
        end = time.perf_counter() - t0
    bar.update(1)
    usage = out["usage"] or {}
    chunks = [c - start for c in out["chunks"]]
    ok = not out["error"] and out["done"] and bool(chunks)
    if not out["error"] and not ok:
        out["error"] = "stream ended before [DONE]" if not out["done"] else "stream carried no text"
    n_out = usage.get("completion_tokens", len(chunks)) if ok else 0
    ttft = chunks[0] if ok else None
    return {
        "index": req.index,
        "cls": req.cls,
        "success": ok,
        "status": out["status"],
        "error": out["error"],
        "start": start,
        "end": end,
        "e2e": end - start if ok else None,
        "ttft": ttft,
        "itl": [b - a for a, b in zip(chunks, chunks[1:])] if ok else [],
        "tpot": (end - start - ttft) / (n_out - 1) if ok and n_out > 1 else None,
        "chunk_times": chunks,
        "num_chunks": len(chunks),
        "output_tokens": n_out,
        "usage_reported": bool(out["usage"]),
        "input_len": req.input_len,
        "prompt_tokens": usage.get("prompt_tokens"),
        "requested_output": req.output_len,
        "metrics": out["metrics"],
    }


async def _run(args, base_url: str, requests: list[Request]) -> tuple[list[dict], float]:
    import httpx
    from tqdm import tqdm

    conc = args.max_concurrency or len(requests)
    sem = asyncio.Semaphore(max(1, conc))
    limits = httpx.Limits(max_connections=max(1, conc), max_keepalive_connections=max(1, conc))
    timeout = httpx.Timeout(args.request_timeout)
    tasks = []
    with tqdm(
        total=len(requests), desc=f"bench {base_url}", unit="req", disable=args.quiet or None
    ) as bar:
        async with httpx.AsyncClient(
            base_url=base_url, timeout=timeout, limits=limits, trust_env=False
        ) as client:
            t0 = time.perf_counter()
            for req in sorted(requests, key=lambda r: r.arrival):
                delay = t0 + req.arrival - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                tasks.append(asyncio.create_task(_one(client, args, req, t0, sem, bar)))
            results = await asyncio.gather(*tasks)
            duration = time.perf_counter() - t0
    return sorted(results, key=lambda r: r["index"]), duration


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
    g = p.add_argument_group("target")
    g.add_argument(
        "--base-url", default="http://127.0.0.1:8000", help="server (default http://127.0.0.1:8000)"
    )
    g.add_argument(
        "--model",
        default="smollm2-135m",
        help="model name sent in requests; also the default tokenizer",
    )
    g.add_argument(
        "--endpoint",
        choices=["completions", "chat"],
        default="completions",
        help="/v1/completions or /v1/chat/completions (default completions)",
    )
    g.add_argument("--api-key", default=None, help="bearer token (default none)")
    g.add_argument(
        "--tokenizer", default=None, help="model alias/path whose tokenizer sizes prompts"
    )
    g.add_argument(
        "--request-timeout",
        type=float,
        default=600.0,
        help="seconds per request, in total (default 600)",
    )
    g.add_argument(
        "--compare",
        metavar="URL2",
        default=None,
        help="replay the same workload against URL2 after",
    )
    g = p.add_argument_group("workload")
    g.add_argument(
        "--dataset-name",
        choices=["random", "mixed", *SHIPPED_TRACES],
        default=None,
        help="random | mixed | a shipped trace (azure, mooncake); default: the --trace file's "
        "format when --trace is given, else random",
    )
    g.add_argument(
        "--num-prompts", type=int, default=100, help="requests of random / mixed (default 100)"
    )
    g.add_argument("--input-len", type=int, default=256, help="random: prompt tokens (default 256)")
    g.add_argument(
        "--output-len",
        type=int,
        default=128,
        help="random: output tokens, EOS ignored (default 128)",
    )
    g.add_argument(
        "--range-ratio",
        type=float,
        default=0.0,
        help="random: lengths uniform in len*(1-r)..len*(1+r) (default 0)",
    )
    g.add_argument(
        "--request-rate", type=float, default=math.inf, help="requests/s (default inf: all at once)"
    )
    g.add_argument(
        "--burstiness",
        type=float,
        default=1.0,
        help="gamma shape of inter-arrivals (default 1: Poisson)",
    )
    g.add_argument(
        "--max-concurrency",
        type=int,
        default=None,
        help="cap on requests in flight, a closed loop (default none)",
    )
    g.add_argument(
        "--seed", type=int, default=0, help="of lengths, arrivals and prompt text (default 0)"
    )
    g.add_argument(
        "--long-fraction",
        type=float,
        default=0.05,
        help="mixed: share of long requests (default 0.05)",
    )
    g.add_argument(
        "--long-input-len", type=int, default=2000, help="mixed: long prompt tokens (default 2000)"
    )
    g.add_argument(
        "--long-output-len", type=int, default=256, help="mixed: long output tokens (default 256)"
    )
    g.add_argument(
        "--short-input-len", type=int, default=30, help="mixed: short prompt tokens (default 30)"
    )
    g.add_argument(
        "--short-output-len", type=int, default=30, help="mixed: short output tokens (default 30)"
    )
    g.add_argument(
        "--priority-by-class",
        action="store_true",
        help='short -> "interactive", long -> "standard"',
    )
    g = p.add_argument_group("trace replay (azure, mooncake)")
    g.add_argument(
        "--trace",
        default=None,
        help="a trace file (Azure CSV or Mooncake JSONL, .xz/.gz read "
        "compressed), or azure / mooncake for the shipped traces; "
        "default: the --dataset-name trace",
    )
    g.add_argument(
        "--window-start", type=float, default=0.0, help="seconds into the trace (default 0)"
    )
    g.add_argument(
        "--window-seconds",
        type=float,
        default=None,
        help="seconds of trace replayed (default: to the end)",
    )
    g.add_argument(
        "--max-requests",
        type=int,
        default=None,
        help="first N requests of the window (default all)",
    )
    g.add_argument(
        "--time-scale",
        type=float,
        default=1.0,
        help="multiply inter-arrival gaps (0.1 = 10x faster; default 1)",
    )
    g.add_argument(
        "--length-scale",
        type=float,
        default=1.0,
        help="multiply input and output lengths (default 1)",
    )
    g.add_argument(
        "--max-input-len", type=int, default=None, help="cap on scaled prompt tokens (default none)"
    )
    g.add_argument(
        "--max-output-len",
        type=int,
        default=None,
        help="cap on scaled output tokens (default none)",
    )
    g.add_argument("--strict", action="store_true", help="reject a trace with malformed lines")
    g = p.add_argument_group("report")
    g.add_argument(
        "--goodput",
        nargs="+",
        default=None,
        metavar="KEY:MS",
        help="goodput SLOs in milliseconds, vLLM's syntax: ttft:500 tpot:100 e2el:10000 "
        "(default none)",
    )
    g.add_argument(
        "--percentile-metrics",
        default="ttft,itl,tpot,e2el",
        help="latency rows printed, of ttft, itl, tpot, e2el (default all four; the JSON has all)",
    )
    g.add_argument(
        "--metric-percentiles",
        default="50,90,95,99",
        help="percentiles printed and saved, e.g. 50,99,99.9 (default 50,90,95,99)",
    )
    g.add_argument(
        "--save-result", action="store_true", help="write the result JSON (to --result-dir)"
    )
    g.add_argument(
        "--result-dir", default=None, help="folder of the saved result (default: the current one)"
    )
    g.add_argument(
        "--result-filename",
        default=None,
        help="file name of the saved result "
        "(default: tandem-<dataset>-<rate>qps-<concurrency>conc-<time>.json)",
    )
    g.add_argument("--plot", dest="plot_dir", default=None, help="write PNG plots into this folder")
    g.add_argument("--quiet", action="store_true", help="no progress bar")


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
        results, duration = asyncio.run(_run(args, url.rstrip("/"), requests))
        runs.append(report.build_run(url, results, duration, slo, pcts))
        runs[-1]["server_counters"] = run_counters(before, scrape(url, args.api_key))
        runs[-1]["prefix_ideal"] = prefix_ideal(args, requests, url)
    out = {
        "config": {k: v for k, v in vars(args).items() if k not in ("func",)},
        "workload": workload,
        "results": runs[0],
    }
    print(report.format_run(runs[0], workload, metrics, shown))
    for run in runs:
        print(f"{run['base_url']}: {format_counters(run['server_counters'])}")
        if run["prefix_ideal"]:
            print(f"{run['base_url']}: {format_ideal(run['server_counters'], run['prefix_ideal'])}")
    if len(runs) == 2:
        out["compare"], out["ratios"] = (
            runs[1],
            report.ratios(runs[0]["summary"], runs[1]["summary"]),
        )
        warning = warm_mismatch([run["server_counters"] for run in runs])
        if warning:
            print(warning)
        print(report.format_compare(runs[0], runs[1], out["ratios"]))
    if args.plot_dir:
        out["plots"] = report.write_plots(Path(args.plot_dir), runs)
    if save:
        save.parent.mkdir(parents=True, exist_ok=True)
        save.write_text(json.dumps(report.jsonable(out), indent=2))
        print(f"wrote {save}")
    return out
