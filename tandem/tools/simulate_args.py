"""`tandem simulate`'s flags, a function per group: the workload, the simulated cluster, each
instance's engine, the report."""

from __future__ import annotations

import argparse

from tandem.cluster.policy.routing import RoutingWeights
from tandem.config.args import add_engine_arguments
from tandem.sim.cluster import MODES

ENGINE_OPTIONS = (
    "max_num_seqs",
    "max_num_batched_tokens",
    "max_model_len",
    "l2_min_share",
    "l1_step_time",
    "enable_prefix_caching",
)
# The engine options the simulated instances model, from a YAML or flags; a profile stands for
# the rest (the model, its dtype and weights, the KV pool's size and block size).
SIMULATED = (
    *ENGINE_OPTIONS,
    "scheduling_policy",
    "queue_order",
    "max_preemptions",
    "preemption_mode",
    "l1_max_prompt_tokens",
    "l1_max_tokens",
    "l1_hold_s",
    "max_prefix_tokens",
    "min_match_length",
)
# An instance stands for a GPU server (the profiles' accelerators): vLLM's 256 seats, not the
# CPU engine's 128.
ENGINE_DEFAULTS = {"max_num_seqs": 256}


def add_workload_arguments(p: argparse.ArgumentParser) -> None:
    """The requests: a trace window, a bench run's requests, or a synthetic mix."""
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


def add_cluster_arguments(p: argparse.ArgumentParser) -> None:
    """The cost model, the instance counts, modes and policies of the grid, routing."""
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
        "--seq-overhead-ms",
        type=float,
        default=0.0,
        help="add to a step for each request decoding in it: the front end's work for the "
        "token it streams, where it shares a CPU host's cores (`tandem bench fidelity` "
        "measures it)",
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
    g.add_argument(
        "--policy",
        default=None,
        help="comma list of fcfs, multilevel (default: the --config YAML's "
        "serving.scheduler.policy, else fcfs)",
    )
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


def add_instance_arguments(p: argparse.ArgumentParser) -> None:
    """Each instance's engine: a serving YAML and the flags over it."""
    g = p.add_argument_group("engine (each instance)")
    g.add_argument(
        "--config",
        default=None,
        help="serving YAML (its engine/cache/scheduler sections; the flags below override it)",
    )
    add_engine_arguments(p, ENGINE_OPTIONS, defaults=ENGINE_DEFAULTS)


def add_report_arguments(p: argparse.ArgumentParser) -> None:
    """The goodput SLOs and the JSON copy of the figures."""
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
