"""`tandem bench scheduler`: scheduling plus bookkeeping cost per step, with no model.

N requests of uneven prompt length are admitted and prefilled; then, in the steady decode
state, each step is `schedule()` + `update_from_output()` with a null executor that samples
one token per request. The executor's own cost is not counted; a step's time is the CPU time
of the thread that runs it."""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

from tandem.config import SchedulerConfig
from tandem.core.kv_cache_coordinator import cdiv
from tandem.core.kv_cache_manager import KVCacheManager
from tandem.core.outputs import ModelRunnerOutput, SchedulerOutput
from tandem.core.request import Request
from tandem.core.sampling_params import SamplingParams
from tandem.core.scheduler import Scheduler
from tandem.heap import freeze_startup_heap


def null_execute(sched: Scheduler, out: SchedulerOutput) -> ModelRunnerOutput:
    result = ModelRunnerOutput()
    for req_id in out.num_scheduled_tokens:
        req = sched.requests.get(req_id)
        if req is not None and req.num_computed_tokens == req.num_tokens:
            result.sampled_token_ids[req_id] = [7]
    return result


def measure(num_running: int, steps: int, policy: str, seed: int = 0, block_size: int = 16) -> dict:
    rng = random.Random(seed)
    prompts = [rng.randint(16, 2048) for _ in range(num_running)]
    max_len, budget = (
        4096,
        max(num_running, 65536),
    )  # a large budget keeps the setup (prefill) short
    # Early requests decode while later ones prefill: leave room for those tokens too, so
    # the measurement sees no preemption.
    extra = sum(prompts) // budget + steps + 8
    # A quarter more: multilevel holds blocks back for L2's share, which is not a shortage.
    blocks = sum(cdiv(p + extra, block_size) for p in prompts) * 5 // 4 + 64
    kv = KVCacheManager(max(blocks, cdiv(max_len, block_size)), block_size)
    cfg = SchedulerConfig(
        max_num_seqs=num_running, max_num_batched_tokens=budget, scheduling_policy=policy
    )
    sched = Scheduler(cfg, kv, time.monotonic, max_len)
    # As the engine core does once built: its block pool is out of the collector's full scans.
    freeze_startup_heap("bench scheduler")
    params = SamplingParams(max_tokens=extra + 1000, ignore_eos=True)
    for i, p in enumerate(prompts):
        sched.add_request(
            Request(
                f"r{i}",
                [rng.randrange(32000) for _ in range(p)],
                params,
                priority=rng.choice((1, 2, 3)) if policy == "multilevel" else 2,
            )
        )
    while len(sched.running) < num_running or any(r.num_output_tokens == 0 for r in sched.running):
        out = sched.schedule()
        sched.update_from_output(out, null_execute(sched, out))
    # CPU time of this thread: on a shared machine, wall time also counts waits for a core.
    times = []
    for _ in range(steps):
        t0 = time.thread_time()
        out = sched.schedule()
        t1 = time.thread_time()
        result = null_execute(sched, out)
        t2 = time.thread_time()
        sched.update_from_output(out, result)
        t3 = time.thread_time()
        times.append((t1 - t0) + (t3 - t2))
    assert sched.num_preemptions == 0, "the bench pool was sized to avoid preemption"
    return {
        "running": num_running,
        "policy": policy,
        "steps": steps,
        "ms_per_step_median": statistics.median(times) * 1e3,
        "ms_per_step_mean": statistics.fmean(times) * 1e3,
        "us_per_request": statistics.median(times) * 1e6 / num_running,
    }


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--running", default="64,256,1024,4096", help="comma-separated running request counts"
    )
    p.add_argument(
        "--steps", type=int, default=50, help="scheduler steps timed per running count (default 50)"
    )
    p.add_argument(
        "--policy",
        choices=["fcfs", "multilevel"],
        default="fcfs",
        help="scheduling policy timed (default fcfs)",
    )
    p.add_argument(
        "--json",
        dest="json_path",
        default=None,
        help="also write every figure as JSON to this path",
    )


def main(args: argparse.Namespace) -> dict:
    rows = [measure(int(n), args.steps, args.policy) for n in args.running.split(",")]
    print(f"{'running':>8} {'ms/step (median)':>17} {'ms/step (mean)':>15} {'us/request':>11}")
    for r in rows:
        print(
            f"{r['running']:>8} {r['ms_per_step_median']:>17.3f} {r['ms_per_step_mean']:>15.3f} "
            f"{r['us_per_request']:>11.2f}"
        )
    report = {"policy": args.policy, "results": rows}
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump(report, f, indent=2)
    return report
