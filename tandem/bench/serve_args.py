"""The flags of `tandem bench serve`, one function per argument group: the target server,
the workload, trace replay and the report."""

from __future__ import annotations

import argparse
import math

from tandem.workload.traces import SHIPPED_TRACES


def token_counts(text: str) -> list[int]:
    """An option's "N" or "N,N,...": positive token counts."""
    try:
        counts = [int(n) for n in text.split(",")]
    except ValueError:
        counts = []
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give positive token counts, e.g. 8192,32000")
    return counts


def add_target_arguments(p: argparse.ArgumentParser) -> None:
    """The server under test and how requests reach it."""
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


def add_workload_arguments(p: argparse.ArgumentParser) -> None:
    """Which workload, the lengths of random / mixed requests, and when they arrive."""
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
        "--long-input-len",
        type=token_counts,
        default=[2000],
        metavar="N[,N,...]",
        help="mixed: long prompt tokens, or several lengths (documents of 8192,32000 tokens, say) "
        "that the long requests take in turn (default 2000)",
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


def add_trace_arguments(p: argparse.ArgumentParser) -> None:
    """A window of a trace replayed, scaled in time and length."""
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


def add_report_arguments(p: argparse.ArgumentParser) -> None:
    """What is printed, saved and plotted."""
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
