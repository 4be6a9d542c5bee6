"""What the in-process benchmarks share: a run in a fresh process (so its peak memory is its
own) and its arguments, that process's peak RSS and GPU memory, a new LLM after the last one's
memory is given back, stepping an engine until every request has prefilled (so the decode that
follows can be timed alone), and the figures of its step counters."""

from __future__ import annotations

import argparse
import gc
import multiprocessing as mp
import queue as queue_module
import resource


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def peak_gpu_mb() -> float | None:
    import torch

    return torch.cuda.max_memory_reserved() / 2**20 if torch.cuda.is_initialized() else None


def replace_args(args: argparse.Namespace, **changes) -> argparse.Namespace:
    """A copy of a run's arguments with `changes` (another configuration of the same run)."""
    return argparse.Namespace(**{**vars(args), **changes})


def new_llm(model: str, **options):
    """An LLM, after the memory of the ones before it is given back (an engine is a reference
    cycle: only the collector frees it)."""
    import torch

    from tandem import LLM

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return LLM(model, **options)


def _child(fn, args, requests, queue) -> None:
    try:
        result = fn(args, requests)
    except BaseException as e:
        queue.put((False, f"{type(e).__name__}: {e}"))
        raise
    queue.put((True, result))


def in_subprocess(fn, args, requests) -> dict:
    """fn(args, requests) in a fresh process (its peak memory is its own). Its error, or its
    death before it answers (killed for memory, say), is raised here rather than waited on; if
    this process stops waiting (an error, Ctrl-C), the child is stopped too."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_child, args=(fn, args, requests, queue))
    proc.start()
    try:
        while True:
            try:
                ok, result = queue.get(timeout=1.0)
                break
            except queue_module.Empty:
                if not proc.is_alive() and queue.empty():
                    raise RuntimeError(
                        f"the benchmark's process died (exit code {proc.exitcode}) "
                        "before it answered"
                    ) from None
    except BaseException:
        proc.terminate()
        proc.join()
        raise
    proc.join()
    if not ok:
        raise RuntimeError(f"in the benchmark's process: {result}")
    return result


def until_first_tokens(engine, request_ids: list[str]) -> None:
    """Step until every one of the requests has its first token: each has prefilled."""
    waiting = set(request_ids)
    while waiting:
        waiting -= {out.request_id for out in engine.step() if out.outputs[0].token_ids}


def gpu_step_ms(before, after) -> dict:
    """CUDA: the GPU busy per step and idle between steps, from CUDA events
    (executor/step_events.py), between two StepCounters; None off CUDA."""
    if after.gpu_num_steps is None:
        return {"gpu_busy_ms": None, "gpu_gap_ms": None}
    return {
        "gpu_busy_ms": (after.gpu_busy_seconds - before.gpu_busy_seconds)
        * 1e3
        / max(after.gpu_num_steps - before.gpu_num_steps, 1),
        "gpu_gap_ms": (after.gpu_gap_seconds - before.gpu_gap_seconds)
        * 1e3
        / max(after.gpu_num_gaps - before.gpu_num_gaps, 1),
    }


def spec_summary(stats) -> dict:
    """Speculative decoding figures of a run (core/spec_decode.SpecDecodeStats)."""
    return {
        "acceptance_rate": stats.acceptance_rate,
        "mean_accepted_length": stats.mean_accepted_length,
        "num_drafts": stats.num_drafts,
        "num_draft_tokens": stats.num_draft_tokens,
        "num_accepted_tokens": stats.num_accepted_tokens,
    }
