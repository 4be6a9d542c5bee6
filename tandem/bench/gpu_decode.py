"""`bench gpu`'s decode part: the time of a steady-state decode step per batch size beside the
bandwidth roofline, and a torch.profiler table of steps at the largest batch."""

from __future__ import annotations

import random
import time

from tandem.bench.measure import gpu_step_ms, new_llm, until_first_tokens


def decode_steps(args, batches: list[int], eager: bool, profile: bool) -> dict:
    """Per batch size: ms per decode step (engine.step, steady state) and the roofline."""
    from tandem import SamplingParams

    llm = new_llm(
        args.model,
        dtype=args.dtype,
        device=args.device,
        max_num_seqs=max(batches),
        max_num_batched_tokens=8192,
        kv_cache_memory=args.kv_cache_memory,
        enforce_eager=eager,
    )
    engine, info = llm.engine, llm.engine.info()
    weight_bytes, kv_per_token = info.decode_weight_bytes, info.kv_bytes_per_token
    rng = random.Random(1)
    out = {"weight_bytes": weight_bytes, "kv_bytes_per_token": kv_per_token, "batches": {}}
    if info.graphs_captured:
        out["capture_seconds"], out["capture_mib"] = (
            info.graph_capture_seconds,
            info.graph_capture_bytes / 2**20,
        )
    params = SamplingParams(temperature=0, max_tokens=10_000, ignore_eos=True)
    for b in batches:
        ids = [
            engine.add_request(
                [rng.randrange(engine.vocab_size) for _ in range(args.decode_prompt)], params
            )
            for _ in range(b)
        ]
        until_first_tokens(engine, ids)
        for _ in range(3):  # steady state: every request decoding, the pipeline full
            engine.step()
        before = engine.step_counters()
        start = time.perf_counter()
        for _ in range(args.decode_steps):
            engine.step()
        step_s = (time.perf_counter() - start) / args.decode_steps
        context = args.decode_prompt + 3 + args.decode_steps // 2  # mean over the timed steps
        read = weight_bytes + b * context * kv_per_token
        out["batches"][b] = {
            "ms_per_step": step_s * 1e3,
            "bytes_read_per_step": read,
            "achieved_gb_s": read / step_s / 1e9,
            "roofline_fraction": read / step_s / args.peak_bandwidth,
            "roofline_ms": read / args.peak_bandwidth * 1e3,
            **gpu_step_ms(before, engine.step_counters()),
        }
        if profile and b == max(batches):
            out["profile"] = _profile(engine, 5)
        for i in ids:
            engine.abort_request(i)
        while engine.has_unfinished_requests():
            engine.step()
    llm.engine.shutdown()
    return out


def _profile(engine, steps: int) -> str:
    import torch
    from torch._C._profiler import _ExperimentalConfig
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + (
        [ProfilerActivity.CUDA] if torch.cuda.is_available() else []
    )
    try:  # the steps run on the executor's worker thread (async scheduling)
        config = _ExperimentalConfig(profile_all_threads=True)
    except TypeError:
        # an older torch: CUDA kernels are still recorded, host ops of that thread not
        config = None
    with profile(activities=activities, experimental_config=config) as prof:
        for _ in range(steps):
            engine.step()
    key = "cuda_time_total" if torch.cuda.is_available() else "cpu_time_total"
    return prof.key_averages().table(sort_by=key, row_limit=20)
