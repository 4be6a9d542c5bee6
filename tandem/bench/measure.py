"""What the in-process benchmarks share: a run in a fresh process (so its peak memory is its
own), that process's peak RSS and GPU memory, and stepping an engine until every request has
prefilled (so the decode that follows can be timed alone)."""

from __future__ import annotations

import multiprocessing as mp
import queue as queue_module
import resource


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def peak_gpu_mb() -> float | None:
    import torch

    return torch.cuda.max_memory_reserved() / 2**20 if torch.cuda.is_initialized() else None


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
