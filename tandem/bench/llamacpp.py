"""`tandem bench llamacpp`: decode tok/s of Tandem and of llama.cpp's `llama-batched-bench` on the
same GGUF, same threads, same batch sizes, side by side in one run (with --prefill-lens, prefill
tok/s against `llama-bench` instead: bench/llamacpp_prefill.py).

Both sides prefill B random prompts of `--prompt-len` tokens and then time the decode steps only:
Tandem as `bench offline --quantization` does (bench/quantization.py: B x (output_len - 1) tokens
over the time after every request has its first token), llama.cpp as its S_TG column (B x ntg
over the ntg decode steps after the prompt), with ntg = output_len - 1 so both take the same
steps over the same KV lengths. The sides alternate for `--repeats` rounds and each figure keeps
its best, which is what a shared, noisy machine allows.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
from pathlib import Path

from tandem.config.args import add_engine_arguments

LLAMA = "llama.cpp"


def llama_cpp_tool(name: str, path: str | None) -> Path:
    """The llama.cpp binary `name`: `path` when given, else the one on PATH; refused in words
    when there is none to run."""
    if path is not None:
        found = Path(path).expanduser()
        if not (found.is_file() and os.access(found, os.X_OK)):
            raise FileNotFoundError(f"{name}: {found} is not an executable file")
        return found
    found = shutil.which(name)
    if found is None:
        raise FileNotFoundError(
            f"{name} is not on PATH: build llama.cpp's tools and pass the binary with --{name} PATH"
        )
    return Path(found)


def model_gguf(model: str) -> Path:
    """The GGUF file both sides load for `--model`."""
    from tandem.models.loader.model_files import gguf_source

    gguf = gguf_source(model)
    if gguf is None:
        raise ValueError(f"--model {model!r}: llama.cpp needs a .gguf file (or an alias of one)")
    return gguf


def parse_batched_bench(text: str) -> dict[int, dict[str, float]]:
    """llama-batched-bench's markdown table -> {B: {column: value}}, columns by their header
    names (PP, TG, B, N_KV, T_PP s, S_PP t/s, T_TG s, S_TG t/s, ...), log lines around it
    ignored."""
    header: list[str] | None = None
    rows: dict[int, dict[str, float]] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line.startswith("|"):
            continue
        cells = [c.strip() for c in line.strip("|").split("|")]
        if "S_TG t/s" in cells and "B" in cells:
            header = cells
        elif (
            header is not None
            and len(cells) == len(header)
            and not set("".join(cells)) <= set("-: ")
        ):
            try:
                row = dict(zip(header, map(float, cells)))
            except ValueError:
                continue
            rows[int(row["B"])] = row
    if header is None:
        raise ValueError("no llama-batched-bench table (a header with S_TG t/s) in its output")
    return rows


def batched_bench_command(tool: Path, gguf: Path, args: argparse.Namespace) -> list[str]:
    batches = [int(b) for b in args.batch_sizes.split(",")]
    n_kv = max(batches) * (args.prompt_len + args.output_len)
    return [
        str(tool),
        "-m",
        str(gguf),
        "-c",
        str(n_kv),
        "-npp",
        str(args.prompt_len),
        "-ntg",
        str(args.output_len - 1),
        "-npl",
        args.batch_sizes,
        "-t",
        str(args.num_threads),
    ]


def run_llama(command: list[str], batches: list[int]) -> dict[int, float]:
    """S_TG per batch size; every batch size asked for must be in the table."""
    proc = subprocess.run(command, capture_output=True, text=True)
    output = proc.stdout + proc.stderr
    if proc.returncode != 0:
        tail = "\n".join(output.strip().splitlines()[-8:])
        raise ValueError(f"llama-batched-bench failed (exit {proc.returncode}):\n{tail}")
    rows = parse_batched_bench(output)
    missing = [b for b in batches if b not in rows]
    if missing:
        raise ValueError(f"llama-batched-bench gave no row for batch size(s) {missing}")
    return {b: rows[b]["S_TG t/s"] for b in batches}


def _tandem_args(args: argparse.Namespace) -> argparse.Namespace:
    """What bench/quantization.run_precision reads."""
    return argparse.Namespace(
        model=args.model,
        dtype=args.dtype,
        kv_cache_dtype=args.kv_cache_dtype,
        device="cpu",
        batch_sizes=args.batch_sizes,
        prompt_len=args.prompt_len,
        output_len=args.output_len,
        kv_cache_memory=args.kv_cache_memory,
        num_threads=args.num_threads,
        seed=args.seed,
    )


def compare(args: argparse.Namespace) -> dict:
    """Every side (each Tandem precision, then llama.cpp) for `repeats` rounds, the order
    rotating by one each round; each figure keeps its best."""
    from tandem.bench.measure import in_subprocess
    from tandem.bench.quantization import RunPrecision

    gguf = model_gguf(args.model)
    command = batched_bench_command(
        llama_cpp_tool("llama-batched-bench", args.llama_batched_bench), gguf, args
    )
    batches = [int(b) for b in args.batch_sizes.split(",")]
    sides = [*args.quantization.split(","), LLAMA]
    best = {side: dict.fromkeys(batches, 0.0) for side in sides}
    peak_rss_mb: dict[str, float] = {}
    served: dict[str, str] = {}  # side -> the precision it ran ("auto" resolves to the file's)
    kv_dtypes: dict[str, str] = {}
    for round_ in range(args.repeats):
        for side in sides[round_ % len(sides) :] + sides[: round_ % len(sides)]:
            if side == LLAMA:
                got = run_llama(command, batches)
            else:
                run = in_subprocess(RunPrecision(side), _tandem_args(args), None)
                got, peak_rss_mb[side], served[side] = (
                    run["decode_tok_s"],
                    run["peak_rss_mb"],
                    run["precision"],
                )
                kv_dtypes[side] = run["kv_cache_dtype"]
            best[side] = {b: max(best[side][b], got[b]) for b in batches}
    label = {
        side: side if served.get(side, side) == side else f"{side} ({served[side]})"
        for side in sides
    }
    return {
        "model": str(gguf),
        "llama_command": " ".join(command),
        "decode_tok_s": {label[side]: best[side] for side in sides},
        "ratio": {
            label[side]: {b: best[side][b] / best[LLAMA][b] for b in batches} for side in sides[:-1]
        },
        "tandem_peak_rss_mb": {label[side]: rss for side, rss in peak_rss_mb.items()},
        "tandem_kv_cache_dtype": {label[side]: kv for side, kv in kv_dtypes.items()},
    }


def print_table(report: dict) -> None:
    print(f"{report['model']}, against `{report['llama_command']}`; decode tok/s")
    sides = list(report["decode_tok_s"])
    print(
        f"{'batch':>5} "
        + " ".join(f"{'tandem ' + s if s != LLAMA else 'llama.cpp S_TG':>15}" for s in sides)
        + " "
        + " ".join(f"{s + '/llama.cpp':>15}" for s in report["ratio"])
    )
    for b in report["decode_tok_s"][LLAMA]:
        print(
            f"{b:>5} "
            + " ".join(f"{report['decode_tok_s'][s][b]:>15.1f}" for s in sides)
            + " "
            + " ".join(f"{r[b]:>14.2f}x" for r in report["ratio"].values())
        )
    print(
        "tandem peak RSS: "
        + ", ".join(f"{s} {mb:,.0f} MiB" for s, mb in report["tandem_peak_rss_mb"].items())
    )
    print(
        "tandem KV cache: "
        + ", ".join(f"{s} {kv}" for s, kv in report["tandem_kv_cache_dtype"].items())
        + " (llama.cpp's: f16)"
    )


def add_arguments(p: argparse.ArgumentParser) -> None:
    # --model: a .gguf file or an alias of one. Both sides run the same number of threads, which
    # llama.cpp needs as a number: 2, this machine's cores, rather than the engine's "all cores".
    # (--quantization and --seed are this command's own: Tandem's precisions, each a column, and
    # the random prompts' seed; llama.cpp's KV cache is f16.)
    add_engine_arguments(
        p,
        ("model", "dtype", "kv_cache_dtype", "kv_cache_memory", "num_threads"),
        defaults={"num_threads": 2},
        store_defaults=True,
    )
    p.add_argument(
        "--quantization",
        default="int4",
        help="Tandem's precision, or several comma-separated, each its own column (default int4)",
    )
    p.add_argument(
        "--batch-sizes",
        default="1,16",
        help="comma-separated batch sizes; Tandem's KV pool is sized for the largest "
        "unless --kv-cache-memory (default 1,16)",
    )
    p.add_argument(
        "--prompt-len", type=int, default=128, help="prompt tokens per request (default 128)"
    )
    p.add_argument(
        "--output-len",
        type=int,
        default=128,
        help="tokens out per request; llama.cpp decodes output_len - 1 after its prompt "
        "(default 128)",
    )
    p.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="rounds, alternating the sides; best kept (default 1)",
    )
    p.add_argument(
        "--seed", type=int, default=0, help="seed of Tandem's random prompts (default 0)"
    )
    p.add_argument(
        "--llama-batched-bench",
        default=None,
        metavar="PATH",
        help="llama-batched-bench binary (default: the one on PATH)",
    )
    p.add_argument(
        "--prefill-lens",
        default=None,
        metavar="N,N,...",
        help="measure prefill instead: tok/s of one request of each length against "
        "`llama-bench -p N -n 0` (its own --quantization, one precision)",
    )
    p.add_argument(
        "--llama-bench",
        default=None,
        metavar="PATH",
        help="llama-bench binary, for --prefill-lens (default: the one on PATH)",
    )
    p.add_argument(
        "--json", dest="json_path", default=None, help="also write the figures as JSON to this path"
    )


def main(args: argparse.Namespace) -> dict:
    if args.prefill_lens:
        report = prefill(args)
    else:
        report = decode(args)
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump(report, f, indent=2)
    return report


def prefill(args: argparse.Namespace) -> dict:
    from tandem.bench import llamacpp_prefill

    if "," in args.quantization:
        raise ValueError("--prefill-lens measures one --quantization at a time")
    tool = llama_cpp_tool("llama-bench", args.llama_bench)
    report = llamacpp_prefill.compare(args, model_gguf(args.model), tool)
    llamacpp_prefill.print_table(report)
    return report


def decode(args: argparse.Namespace) -> dict:
    if args.output_len < 2:
        raise ValueError(
            "--output-len must be at least 2 (one token from the prompt, then decode steps)"
        )
    report = compare(args)
    print_table(report)
    return report
