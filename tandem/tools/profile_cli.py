"""`tandem profile`: time the real model executor on steps of chosen shapes and fit the cost
model the simulator and the planner use; or write a roofline profile (`--roofline h100`).

Steps are built as SchedulerOutputs directly, with disjoint block ranges, so each shape is
exactly the one asked for: a decode of B requests at context C is B requests whose KV (zeros:
timing does not depend on the values) is already "computed", a prefill chunk is a request
with `before` tokens computed and `chunk` to go. Each shape: one untimed step, then the
median of `--repeats` timed `execute_model` calls."""

from __future__ import annotations

import argparse
import datetime
import itertools
import os
import statistics
import time

from tandem.config.args import add_engine_arguments, given
from tandem.sim.cost_model import FEATURES, BatchShape, CostModel, measured
from tandem.tools.machine import describe, machine_info

# (requests, chunk, tokens before the chunk); (batch, context); (chunk, batch, context)
GRID = {
    "prefill": [(1, t, 0) for t in (16, 32, 64, 128, 256, 512, 1024, 2048)]
    + [(n, t // n, 0) for t in (256, 1024, 2048) for n in (4, 16)]
    + [(1, 512, 512), (1, 512, 1536), (2, 1024, 1024)],
    "decode": list(itertools.product((1, 2, 4, 8, 16, 32, 64), (64, 256, 1024))),
    "mixed": [(256, 8, 256), (512, 32, 256), (128, 16, 1024), (1024, 64, 512)],
}
QUICK = {
    "prefill": [(1, 16, 0), (1, 64, 0), (2, 32, 0), (1, 32, 32)],
    "decode": [(1, 32), (4, 32), (4, 64)],
    "mixed": [(32, 2, 32)],
}


class NoRoom(Exception):
    """The shape needs more KV blocks than the pool has."""


class Driver:
    """Feeds hand-built steps to a real executor and times them."""

    def __init__(self, runner, vocab_size: int, repeats: int, temperature: float = 0.0) -> None:
        import random

        self.runner, self.repeats, self.rng = runner, repeats, random.Random(0)
        self.temperature = temperature
        self.vocab, self.ids, self.next_block = vocab_size, itertools.count(), 0

    def _new(self, prompt_len: int, computed: int, extra: int):
        from tandem.core.outputs import NewRequestData
        from tandem.core.sampling_params import SamplingParams

        bs = self.runner.block_size
        n = -(-(prompt_len + 1 + extra) // bs)
        if self.next_block + n > self.runner.num_kv_blocks:
            raise NoRoom
        blocks = list(range(self.next_block, self.next_block + n))
        self.next_block += n
        tokens = [self.rng.randrange(self.vocab) for _ in range(prompt_len + 1)]
        out = (
            tokens[-1:] if computed == prompt_len else []
        )  # a decode: its last token awaits its KV
        return NewRequestData(
            f"p{next(self.ids)}",
            tokens[:prompt_len],
            out,
            SamplingParams(max_tokens=1 << 20, temperature=self.temperature),
            blocks,
            computed,
        )

    def run(
        self, decodes: tuple[int, int], prefills: tuple[int, int, int]
    ) -> tuple[BatchShape, float] | None:
        """(decode batch, context), (prefill requests, chunk, before): the median step and its
        shape."""
        from tandem.core.outputs import CachedRequestData, SchedulerOutput

        (batch, context), (num_pre, chunk, before) = decodes, prefills
        self.next_block, times, shape = 0, [], None
        try:
            dec = [self._new(context, context, self.repeats + 1) for _ in range(batch)]
            for i in range(self.repeats + 1):
                pre = [self._new(before + chunk, before, 0) for _ in range(num_pre)]
                out = SchedulerOutput(
                    scheduled_new_reqs=pre + (dec if i == 0 else []),
                    scheduled_cached_reqs=[
                        CachedRequestData(d.req_id, [], context + i) for d in dec
                    ]
                    if i
                    else [],
                )
                out.num_scheduled_tokens = {
                    **{d.req_id: 1 for d in dec},
                    **{p.req_id: chunk for p in pre},
                }
                out.total_num_scheduled_tokens = sum(out.num_scheduled_tokens.values())
                t0 = time.perf_counter()
                self.runner.execute_model(out)
                if i:
                    times.append(time.perf_counter() - t0)
                    shape = shape or BatchShape(
                        num_pre * chunk,
                        num_pre * chunk * (before + chunk),
                        batch,
                        batch * (context + 1 + i),
                    )
                self.runner.execute_model(SchedulerOutput(finished_req_ids={p.req_id for p in pre}))
        except NoRoom:
            return None
        finally:
            self.runner.execute_model(SchedulerOutput(finished_req_ids=set(self.runner.requests)))
        return shape, statistics.median(times)


def host_copy_bandwidth(device) -> float:
    """Bytes/s of a 64 MiB copy between device and host (memcpy on a CPU-only machine)."""
    import torch

    src = torch.empty(64 << 20, dtype=torch.uint8, device=device)
    dst = torch.empty(64 << 20, dtype=torch.uint8, pin_memory=device.type == "cuda")
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t0)
    return src.numel() / statistics.median(times)


def measure(args: argparse.Namespace) -> CostModel:
    import torch
    from tqdm import tqdm

    from tandem.config import EngineConfig
    from tandem.executor.model_runner import ModelRunner
    from tandem.models.loader.model_files import resolve_model

    config = EngineConfig.from_kwargs(**given(args, ENGINE_OPTIONS))
    runner = ModelRunner(config, resolve_model(args.model))
    driver = Driver(runner, runner.model_config.vocab_size, args.repeats, args.temperature)
    grid = QUICK if args.quick else GRID
    jobs = (
        [((0, 0), p) for p in grid["prefill"]]
        + [(d, (0, 0, 0)) for d in grid["decode"]]
        + [((b, c), (1, t, 0)) for t, b, c in grid["mixed"]]
    )
    load_before = os.getloadavg()[0]  # other work on the machine skews every figure: record it
    for _ in range(3):  # warm-up: first calls build kernels and fault in weights
        driver.run((2, 32), (1, 64, 0))
    samples, skipped = [], []
    for dec, pre in tqdm(jobs, desc="profile", disable=None):
        res = driver.run(dec, pre)
        if res is None:
            skipped.append([*dec, *pre])
            continue
        s, t = res
        samples.append(
            [s.num_prefill_tokens, s.prefill_attention, s.num_decode_seqs, s.decode_context, t]
        )
    kv_bytes = runner.kv.kv_bytes_per_token
    bw = host_copy_bandwidth(runner.device)
    dtype = str(runner.dtype).removeprefix("torch.")
    gpu = torch.cuda.get_device_name(runner.device) if runner.device.type == "cuda" else None
    info = {
        "model": args.model,
        "device": str(runner.device),
        "dtype": dtype,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "machine": machine_info(torch.get_num_threads(), dtype, gpu),
        "load_average": [load_before, os.getloadavg()[0]],
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "repeats": args.repeats,
        "temperature": args.temperature,
        "features": list(FEATURES),
        "skipped_for_kv_capacity": skipped,
        "host_copy_bandwidth": bw,
        "prefill_table": [
            {"tokens": s[0], "pairs": s[1], "tok_per_s": s[0] / s[4]}
            for s in samples
            if s[0] and not s[2]
        ],
        "decode_table": [
            {"batch": s[2], "context": s[3] // s[2], "tok_per_s": s[2] / s[4]}
            for s in samples
            if s[2] and not s[0]
        ],
    }
    return measured(
        samples,
        block_size=runner.block_size,
        kv_bytes_per_token=kv_bytes,
        kv_capacity_tokens=runner.num_kv_blocks * runner.block_size,
        host_kv_capacity_tokens=runner.num_host_blocks * runner.block_size,
        host_bandwidth=bw,
        link_bandwidth=bw,
        link_latency=50e-6,  # instances on one host: a process-to-process copy
        max_num_batched_tokens=config.scheduler_config.max_num_batched_tokens,
        info=info,
    )


def report(cm: CostModel) -> None:
    i = cm.info
    print(f"cost model: {cm.describe()}")
    if "machine" in i:
        print(f"  measured on: {describe(i['machine'])}")
    print(
        f"  KV: {cm.kv_bytes_per_token} B/token, {cm.kv_capacity_tokens:,} tokens on device, "
        f"{cm.host_kv_capacity_tokens:,} on host; host link {cm.host_bandwidth / 1e9:.1f} GB/s"
    )
    print(
        f"  step = {cm.overhead * 1e3:.3f} ms + sum over terms of max(compute, memory), "
        "per unit of:"
    )
    for name, t in cm.terms.items():
        for kind in ("compute", "memory"):
            nz = [f"{f} {c:.4g} s" for c, f in zip(t[kind], FEATURES) if c]
            if nz:
                print(f"    {name} {kind}: " + ", ".join(nz))
        if "experts" in t:  # (experts, experts per token, seconds to read them all)
            e, k, s = t["experts"]
            print(f"    {name} experts: {s:.4g} s for all {e:.0f}; a step reads those touched")
    if "fit" in i:
        print(
            f"  fit over {len(i['samples'])} steps: "
            f"median relative error {i['fit']['median_rel_error']:.1%}, "
            f"max {i['fit']['max_rel_error']:.1%}"
        )
        for row in i["prefill_table"]:
            print(
                f"  X prefill {row['tokens']:>5} tokens ({row['pairs']:>9,} pairs): "
                f"{row['tok_per_s']:>9,.0f} tok/s"
            )
        for row in i["decode_table"]:
            print(
                f"  Y decode batch {row['batch']:>3} context {row['context']:>5}: "
                f"{row['tok_per_s']:>9,.0f} tok/s"
            )
    print(
        f"  X at {cm.max_num_batched_tokens} tokens: {cm.prefill_throughput():,.0f} tok/s; "
        f"Y at batch 32, context 1024: {cm.decode_throughput(32, 1024):,.0f} tok/s"
    )


# --num-threads 1 is steadier on a shared machine.
ENGINE_OPTIONS = ("model", "dtype", "quantization", "device", "kv_cache_memory", "num_threads")


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_engine_arguments(p, ENGINE_OPTIONS, store_defaults=True)
    p.add_argument("--out", required=True, help="profile JSON to write")
    p.add_argument("--quick", action="store_true", help="a tiny grid (tests)")
    p.add_argument(
        "--repeats", type=int, default=3, help="timed steps per shape (the median is kept)"
    )
    p.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="the profiled requests' sampling: 0 greedy (what the benches send), above 0 the "
        "random path, a few times dearer per sampled row on a CPU (default 0)",
    )
    p.add_argument(
        "--roofline",
        default=None,
        help="no measurement: roofline of this accelerator (h100, h200, a100-80gb)",
    )
    p.add_argument(
        "--model-shape", default=None, help="with --roofline: llama-3-8b, llama-3-70b, ..."
    )
    p.add_argument(
        "--tp", type=int, default=1, help="with --roofline: devices per instance (tensor parallel)"
    )
    p.add_argument(
        "--interconnect",
        default="nvlink",
        help="with --roofline: nvlink | rdma | pcie (P->D KV path)",
    )
    p.add_argument(
        "--step-overhead-ms", type=float, default=None, help="with --roofline: fixed cost per step"
    )


def main(args: argparse.Namespace) -> CostModel:
    if args.repeats < 1 or (args.num_threads is not None and args.num_threads < 1):
        raise ValueError("--repeats and --num-threads must be >= 1")
    if args.temperature < 0:
        raise ValueError("--temperature must be >= 0")
    if args.roofline:
        if not args.model_shape:
            raise ValueError("--roofline needs --model-shape (e.g. llama-3-8b)")
        from tandem.sim.hardware import roofline

        overhead = None if args.step_overhead_ms is None else args.step_overhead_ms / 1e3
        cm = roofline(
            args.roofline,
            args.model_shape,
            tp=args.tp,
            interconnect=args.interconnect,
            step_overhead=overhead,
        )
    elif args.model_shape or args.tp != 1 or args.step_overhead_ms is not None:
        raise ValueError("--model-shape, --tp and --step-overhead-ms apply only with --roofline")
    else:
        cm = measure(args)
    cm.save(args.out)
    report(cm)
    print(f"wrote {args.out}")
    return cm
