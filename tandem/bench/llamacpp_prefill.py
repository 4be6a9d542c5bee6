"""`tandem bench llamacpp --prefill-lens 512,2048,8000`: prefill tok/s of one request of N
tokens, Tandem against llama.cpp's `llama-bench -p N -n 0` on the same GGUF and threads.

Tandem: one request of N random tokens and one token out, timed from its arrival to its first
token (chunked by max_num_batched_tokens, as the engine serves it), after a warm-up request.
llama.cpp: llama-bench's tok/s of one repetition (after its own warm-up). Each round runs every
side in a fresh process, the order rotating by one each round; each figure keeps its best, which
is what a shared, noisy machine allows; each run's figures are printed as it ends.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import time
from pathlib import Path

LLAMA = "llama.cpp"


def llama_bench_command(tool: Path, gguf: Path, lens: list[int], threads: int) -> list[str]:
    return [
        str(tool),
        "-m",
        str(gguf),
        "-p",
        ",".join(map(str, lens)),
        "-n",
        "0",
        "-t",
        str(threads),
        "-r",
        "1",
        "-o",
        "json",
    ]


def parse_llama_bench(text: str) -> dict[int, float]:
    """llama-bench's JSON (-o json) -> {prompt tokens: tok/s} of its prompt-only tests."""
    return {
        int(test["n_prompt"]): float(test["avg_ts"])
        for test in json.loads(text[text.index("[") :])
        if int(test["n_gen"]) == 0
    }


def run_llama_bench(command: list[str]) -> dict[int, float]:
    proc = subprocess.run(command, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-8:])
        raise ValueError(f"llama-bench failed (exit {proc.returncode}):\n{tail}")
    return parse_llama_bench(proc.stdout)


def run_tandem(args: argparse.Namespace, _requests) -> dict:
    """One process: load the model, then prefill one request of each length in turn."""
    import random

    from tandem import LLM, SamplingParams
    from tandem.bench.measure import until_first_tokens

    lens = [int(n) for n in args.prefill_lens.split(",")]
    llm = LLM(
        args.model,
        dtype=args.dtype,
        quantization=args.quantization,
        kv_cache_dtype=args.kv_cache_dtype,
        kv_cache_memory=args.kv_cache_memory,
        max_model_len=max(lens) + 16,
        max_num_seqs=1,
        num_threads=args.num_threads,
    )
    engine, rng = llm.engine, random.Random(args.seed)
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    llm.generate([[1] * 64], SamplingParams(max_tokens=2, ignore_eos=True))  # warm-up
    tok_s = {}
    for n in lens:
        prompt = [rng.randrange(engine.vocab_size) for _ in range(n)]
        start = time.perf_counter()
        until_first_tokens(engine, [engine.add_request(prompt, params)])
        tok_s[n] = n / (time.perf_counter() - start)
        while engine.has_unfinished_requests():
            engine.step()
    return {"prefill_tok_s": tok_s, "kv_cache_dtype": engine.info().kv_cache_dtype}


def compare(args: argparse.Namespace, gguf: Path, tool: Path) -> dict:
    from tandem.bench.measure import in_subprocess

    lens = [int(n) for n in args.prefill_lens.split(",")]
    command = llama_bench_command(tool, gguf, lens, args.num_threads)
    best = {side: dict.fromkeys(lens, 0.0) for side in ("tandem", LLAMA)}
    kv_dtype = None
    for round_ in range(args.repeats):
        for side in ("tandem", LLAMA) if round_ % 2 == 0 else (LLAMA, "tandem"):
            if side == LLAMA:
                got = run_llama_bench(command)
            else:
                run = in_subprocess(run_tandem, args, None)
                got, kv_dtype = run["prefill_tok_s"], run["kv_cache_dtype"]
            print(f"round {round_ + 1}, {side}: " + ", ".join(f"{n}: {got[n]:.1f}" for n in lens))
            best[side] = {n: max(best[side][n], got[n]) for n in lens}
    return {
        "model": str(gguf),
        "llama_command": " ".join(command),
        "quantization": args.quantization,
        "tandem_kv_cache_dtype": kv_dtype,
        "prefill_tok_s": best,
        "ratio": {n: best["tandem"][n] / best[LLAMA][n] for n in lens},
    }


def print_table(report: dict) -> None:
    print(
        f"{report['model']}, against `{report['llama_command']}`; prefill tok/s of one request "
        f"(tandem {report['quantization']}, KV {report['tandem_kv_cache_dtype']})"
    )
    print(f"{'tokens':>7} {'tandem':>10} {'llama.cpp':>10} {'tandem/llama.cpp':>17}")
    for n, ratio in report["ratio"].items():
        tandem, llama = report["prefill_tok_s"]["tandem"][n], report["prefill_tok_s"][LLAMA][n]
        print(f"{n:>7} {tandem:>10.1f} {llama:>10.1f} {ratio:>16.2f}x")
