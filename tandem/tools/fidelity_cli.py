"""`tandem bench fidelity`: how close `tandem simulate` comes to the real server on the same
requests. A profile of this machine is taken (`--profile`) or made (`tandem profile`); a trace
window is replayed `--replays` times (`tandem bench serve`), each against a fresh `tandem serve`
(a replay of the same prompts would hit the last one's prefix cache); the first replay's
requests are simulated at the times they were sent (`tandem simulate --replay`). For TTFT, ITL
and E2E at p50 / p90 / p99 it prints the simulation's error against the mean of the replays
beside the replays' own spread. Every run is saved under --result-dir.

The simulator's front end (`--frontend-ms`: HTTP, tokenising, detokenising, queueing at the API
process) is measured in the replays themselves, not fitted: per request, the client's E2E less
the engine's own queue + prefill + decode time, which the server reports with each response.
So is the executor's idle time between two busy steps in the replays' step traces, where each
real step is also set against the profile's prediction for its batch (fidelity_steps.py).
What serving adds to a decode step (the front end streaming each token on the executor's cores)
is measured on a calibration load of random requests before the replays
(fidelity_replay.calibrate): a time per step (`--step-overhead-ms`, with the idle time) and
per decoding request (`--seq-overhead-ms`)."""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from tandem.bench.report import SPLIT_KEYS
from tandem.bench.serve_args import add_trace_arguments
from tandem.config.args import add_engine_arguments, given
from tandem.sim.cost_model import CostModel
from tandem.tools import simulate_cli
from tandem.tools.fidelity_replay import calibrate, flags, replay
from tandem.tools.fidelity_steps import compare_steps, decode_excess, format_steps

METRICS = ("ttft_ms", "itl_ms", "e2e_ms")
PCTS = ("p50", "p90", "p99")
TOLERANCE = 0.05  # the goal: within 5% of the real mean, or within the replays' spread if wider
# Of the server and the profile alike: the profile stands for the server's KV pool and its
# batched-token budget.
PROFILE_OPTIONS = ("model", "quantization", "kv_cache_memory", "num_threads")


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_trace_arguments(p)
    p.set_defaults(trace="azure")
    # Pin --kv-cache-memory: by default the pool is sized from the memory free when each
    # process starts, and the profile must stand for the server's pool.
    names = (*PROFILE_OPTIONS, "max_model_len", "max_num_seqs")
    add_engine_arguments(p, names, store_defaults=True)
    p.add_argument(
        "--profile",
        default=None,
        help="a `tandem profile` JSON of this machine and these engine options (default: one is "
        "made first, into --result-dir)",
    )
    p.add_argument(
        "--profile-arg",
        dest="profile_args",
        action="append",
        default=[],
        help="a further flag for the `tandem profile` run (repeat; e.g. --quick)",
    )
    p.add_argument(
        "--serve-arg",
        dest="serve_args",
        action="append",
        default=[],
        help="a further flag for each server started (repeat)",
    )
    p.add_argument("--replays", type=int, default=3, help="real replays (default 3)")
    p.add_argument(
        "--frontend-ms",
        type=float,
        default=None,
        help="the simulator's front-end delay (default: measured in the replays)",
    )
    p.add_argument(
        "--step-overhead-ms",
        type=float,
        default=None,
        help="added to each simulated step (default: measured, the executor's mean idle time "
        "between two busy steps in the replays plus the calibration load's excess a step)",
    )
    p.add_argument(
        "--seq-overhead-ms",
        type=float,
        default=None,
        help="added to a simulated step per request decoding in it (default: measured on the "
        "calibration load)",
    )
    p.add_argument(
        "--result-dir",
        default=None,
        help="where every run is saved (default results/fidelity-<time>)",
    )


def make_profile(args: argparse.Namespace, out: Path) -> Path:
    """`tandem profile` of the engine options the server runs with, in a process of its own."""
    path = out / "profile.json"
    cmd = [sys.executable, "-m", "tandem.cli", "profile", "--out", str(path)]
    subprocess.run(cmd + flags(given(args, PROFILE_OPTIONS)) + args.profile_args, check=True)
    return path


def frontend_seconds(runs: list[dict]) -> float | None:
    """Median over every replayed request of its client E2E less the engine's own time (queue,
    prefill, decode), as the server reported it: what the simulator's front end stands for."""
    gaps = [
        r["e2e"] - sum(float(r["metrics"].get(k) or 0.0) for k in SPLIT_KEYS)
        for run in runs
        for r in run["results"]["requests"]
        if r["success"] and r["metrics"]
    ]
    return statistics.median(gaps) if gaps else None


def step_figures(runs: list[dict], sim: dict) -> dict:
    """The engine's steps, real (its iteration-time counters, mean over the replays) and
    simulated: a step cost the profile leaves out (scheduling, output processing, the API
    process's share of the CPU) shows as a longer real mean step."""
    real = [run["results"]["server_counters"] or {} for run in runs]
    real = [c for c in real if c.get("steps")]
    busy = sim["busy_share"] * sim["summary"]["duration_s"]
    return {
        "real_steps": statistics.fmean(c["steps"] for c in real) if real else None,
        "real_step_ms": statistics.fmean(1e3 * c["step_seconds"] / c["steps"] for c in real)
        if real
        else None,
        "sim_steps": sim["steps"],
        "sim_step_ms": 1e3 * busy / sim["steps"] if sim["steps"] else None,
    }


def simulate(
    args: argparse.Namespace,
    out: Path,
    profile: Path,
    frontend_ms: float,
    step_ms: float,
    seq_ms: float,
) -> dict:
    parser = argparse.ArgumentParser()
    simulate_cli.add_arguments(parser)
    sim = parser.parse_args(
        [
            "--replay",
            str(out / "real-1.json"),
            "--profile",
            str(profile),
            "--instances",
            "1",
            "--frontend-ms",
            f"{frontend_ms:g}",
            "--step-overhead-ms",
            f"{step_ms:g}",
            "--seq-overhead-ms",
            f"{seq_ms:g}",
            "--json",
            str(out / "sim.json"),
            # the server's seats (the simulator's own default is a GPU server's)
            *flags(given(args, ("max_num_seqs", "max_model_len"))),
        ]
    )
    return simulate_cli.main(sim)["results"][0]


def compare(real: list[dict], sim: dict) -> list[dict]:
    """Per metric and percentile: the replays' mean and spread (the largest distance of a replay
    from the mean, as a share of it), the simulation and its error, and whether it is within
    TOLERANCE of the mean or, where that is wider, within the spread."""
    rows = []
    for m in METRICS:
        for p in PCTS:
            values = [s[m][p] for s in real]
            mean = statistics.fmean(values)
            spread = max(abs(v - mean) for v in values) / mean if mean else 0.0
            got = sim[m][p]
            error = (got - mean) / mean if mean else 0.0
            bound = max(TOLERANCE, spread)
            rows.append(
                {
                    "metric": m.removesuffix("_ms"),
                    "pct": p,
                    "real": values,
                    "real_mean": mean,
                    "real_spread": spread,
                    "sim": got,
                    "error": error,
                    "within": abs(error) <= bound,
                    "bound": "5%" if spread <= TOLERANCE else "spread",
                }
            )
    return rows


def format_table(rows: list[dict]) -> str:
    lines = [
        f"{'':11} {'real mean':>10} {'spread':>8} {'simulated':>10} {'error':>8}  verdict",
    ]
    for r in rows:
        verdict = f"within {r['bound']}" if r["within"] else f"outside {r['bound']}"
        lines.append(
            f"{r['metric'].upper():5} {r['pct']:5} {r['real_mean']:10.1f} "
            f"{r['real_spread']:8.1%} {r['sim']:10.1f} {r['error']:+8.1%}  {verdict}"
        )
    return "\n".join(lines)


def main(args: argparse.Namespace) -> dict:
    if args.replays < 1:
        raise ValueError("--replays must be >= 1")
    out = Path(args.result_dir or f"results/fidelity-{time.strftime('%Y%m%d-%H%M%S')}")
    out.mkdir(parents=True, exist_ok=True)
    profile = Path(args.profile) if args.profile else make_profile(args, out)
    cost = CostModel.load(profile)
    excess = (0.0, 0.0)
    if args.step_overhead_ms is None or args.seq_overhead_ms is None:
        excess = decode_excess([calibrate(args, out)], cost)
    runs = [replay(args, out, i) for i in range(1, args.replays + 1)]
    measured = frontend_seconds(runs)
    frontend_ms = args.frontend_ms if args.frontend_ms is not None else (measured or 0.0) * 1e3
    traces = [out / f"steps-{i}.jsonl" for i in range(1, args.replays + 1)]
    per_step = compare_steps(traces, cost)
    # The engine thread's work between two steps (taking the last step's tokens back, topping
    # the next one up) keeps the executor idle: a step cost the profile cannot see.
    step_ms = args.step_overhead_ms
    if step_ms is None:
        step_ms = (per_step["gap_ms"] or 0.0) + 1e3 * excess[0]
    seq_ms = args.seq_overhead_ms if args.seq_overhead_ms is not None else 1e3 * excess[1]
    sim = simulate(args, out, profile, frontend_ms, step_ms, seq_ms)
    rows = compare([run["results"]["summary"] for run in runs], sim["summary"])
    steps = step_figures(runs, sim)
    seen = "not reported" if measured is None else f"{measured * 1e3:.1f} ms"
    print(f"\nfront end: {frontend_ms:.1f} ms per request (measured in the replays: {seen})")
    print(
        f"step overhead: {step_ms:.2f} ms a simulated step, {seq_ms:.3f} ms a decoding request "
        f"(calibration load: {1e3 * excess[0]:.2f} ms a step, {1e3 * excess[1]:.3f} a request)"
    )
    print(format_table(rows))
    if steps["real_step_ms"] is not None:
        print(
            f"engine steps: real {steps['real_steps']:.0f} of {steps['real_step_ms']:.2f} ms "
            f"(mean), simulated {steps['sim_steps']} of {steps['sim_step_ms']:.2f} ms"
        )
    print("real steps against the profile's prediction for the same batch:")
    print(format_steps(per_step))
    # the executor's share of what the simulation adds (the idle time falls between steps)
    executor_ms = max(step_ms - (per_step["gap_ms"] or 0.0), 0.0)
    calibrated_steps = compare_steps(traces, cost.calibrated(1.0, executor_ms / 1e3, seq_ms / 1e3))
    print("... and with the simulation's step and request overheads added:")
    print(format_steps(calibrated_steps))
    report = {
        "config": {k: v for k, v in vars(args).items() if k != "func"},
        "profile": str(profile),
        "frontend_ms": frontend_ms,
        "frontend_ms_measured": measured and measured * 1e3,
        "rows": rows,
        "steps": steps,
        "per_step": per_step,
        "per_step_calibrated": calibrated_steps,
        "step_overhead_ms": step_ms,
        "seq_overhead_ms": seq_ms,
        "calibration_excess_ms": [1e3 * x for x in excess],
    }
    (out / "fidelity.json").write_text(json.dumps(report, indent=2))
    print(f"wrote {out}/fidelity.json")
    return report
