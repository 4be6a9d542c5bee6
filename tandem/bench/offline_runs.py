"""The runs `bench offline` and `bench gpu` time on the same requests (random prompt and output
lengths, ignore_eos): tandem's LLM.generate, with its step figures, and transformers' batched
generate. Each is meant to run in a process of its own (measure.in_subprocess)."""

from __future__ import annotations

import random
import time

from tandem.bench.measure import gpu_step_ms, peak_gpu_mb, peak_rss_mb, spec_summary
from tandem.config.args import given

# The engine options tandem's run takes, and `bench offline` offers as flags (its --quantization
# and --seed are its own: a list of precisions to compare, and the random prompts' seed).
ENGINE_OPTIONS = (
    "model",
    "dtype",
    "kv_cache_dtype",
    "device",
    "kv_cache_memory",
    "max_num_seqs",
    "max_num_batched_tokens",
    "enforce_eager",
    "async_scheduling",
    "deterministic",
    "num_threads",
    "speculative_config",
)


def make_requests(args, vocab_size: int) -> list[tuple[list[int], int]]:
    rng = random.Random(args.seed)
    return [
        (
            [
                rng.randrange(vocab_size)
                for _ in range(rng.randint(args.min_prompt, args.max_prompt))
            ],
            rng.randint(args.min_output, args.max_output),
        )
        for _ in range(args.num_prompts)
    ]


def run_tandem(args, requests) -> dict:
    from tandem import LLM, SamplingParams

    llm = LLM(**given(args, ENGINE_OPTIONS))
    llm.generate([[1] * 16], SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up
    engine = llm.engine
    engine.reset_stats()
    before = engine.step_counters()
    params = [SamplingParams(temperature=0, max_tokens=out, ignore_eos=True) for _, out in requests]
    start = time.perf_counter()
    outs = llm.generate([p for p, _ in requests], params, use_tqdm=args.progress)
    elapsed = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    c = engine.step_counters()
    steps = max(c.num_steps, 1)
    times = dict(c.phase_times, prepare=c.prepare_seconds - before.prepare_seconds)
    per_step_ms = {k: v / steps * 1e3 for k, v in times.items() if k != "gap"}
    per_step_ms["gap"] = times["gap"] / max(c.num_gaps, 1) * 1e3
    return {
        "output_tokens": tokens,
        "seconds": elapsed,
        "output_throughput": tokens / elapsed,
        "async_scheduling": engine.config.scheduler_config.async_scheduling,
        "steps": c.num_steps,
        "ms_per_step": per_step_ms,
        "gap_share_of_execute": times["gap"] / max(times["execute"], 1e-9),
        "kv_utilization_mean": c.kv_utilization_sum / steps,
        "kv_usage_peak": c.kv_usage_peak,
        "dtype": engine.info().dtype,
        "deterministic": engine.config.device_config.deterministic,
        "preemptions": c.num_preemptions,
        "peak_rss_mb": peak_rss_mb(),
        "peak_gpu_mb": peak_gpu_mb(),
        **gpu_step_ms(before, c),
        "spec_decode": spec_summary(c.spec) if engine.config.speculative_config else None,
    }


def run_hf(args, requests) -> dict:
    """transformers' batched generate: left-padded static batches; a batch decodes until
    its longest request is done, and only the tokens each request asked for are counted."""
    import torch
    from tqdm import tqdm

    from tandem.executor.device import resolve_device, resolve_dtype
    from tandem.models.loader.hf_reference import hf_model

    device = resolve_device(args.device)
    dtype = resolve_dtype(args.hf_dtype or args.dtype, device)
    model = hf_model(args.model, dtype).to(device)
    with torch.inference_mode():  # warm-up (CUDA context, kernels), as tandem has
        model.generate(
            torch.ones(1, 4, dtype=torch.long, device=device), max_new_tokens=2, pad_token_id=0
        )
    start = time.perf_counter()
    tokens = 0
    with torch.inference_mode():
        for i in tqdm(range(0, len(requests), args.hf_batch_size), desc="hf generate"):
            batch = requests[i : i + args.hf_batch_size]
            width = max(len(p) for p, _ in batch)
            ids = torch.tensor([[0] * (width - len(p)) + p for p, _ in batch], device=device)
            mask = torch.tensor(
                [[0] * (width - len(p)) + [1] * len(p) for p, _ in batch], device=device
            )
            new = max(o for _, o in batch)
            model.generate(
                ids,
                attention_mask=mask,
                do_sample=False,
                max_new_tokens=new,
                min_new_tokens=new,
                pad_token_id=0,
            )
            tokens += sum(o for _, o in batch)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elapsed = time.perf_counter() - start
    return {
        "output_tokens": tokens,
        "seconds": elapsed,
        "output_throughput": tokens / elapsed,
        "dtype": str(dtype).removeprefix("torch."),
        "batch_size": args.hf_batch_size,
        "peak_rss_mb": peak_rss_mb(),
        "peak_gpu_mb": peak_gpu_mb(),
    }
