"""`tandem bench llamacpp`: decode tok/s of Tandem and of llama.cpp's `llama-batched-bench` on the
same GGUF, same threads, same batch sizes, side by side in one run (bench/llamacpp_decode.py); with
--prefill-lens, prefill tok/s against `llama-bench` instead (bench/llamacpp_prefill.py). This
file: the command's flags, and finding the binaries and the GGUF."""

from __future__ import annotations

import argparse
import json
import os
import shutil
from pathlib import Path

from tandem.bench.serve_args import token_counts
from tandem.config.args import add_engine_arguments


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


def add_arguments(p: argparse.ArgumentParser) -> None:
    # --model: a .gguf file or an alias of one. Both sides run the same number of threads, which
    # llama.cpp needs as a number: 2, this machine's cores, rather than the engine's "all cores".
    # (--quantization, --kv-cache-dtypes and --seed are this command's own: Tandem's precisions
    # and KV dtypes, each a column, and the random prompts' seed.)
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
        "--kv-cache-dtypes",
        default=None,
        metavar="DTYPE,DTYPE,...",
        help="Tandem's KV cache dtypes, each its own column, against llama.cpp with the cache "
        "type of the same width, each its own column too (-ctk/-ctv: bfloat16, float16 and auto "
        "-> f16, int8 -> q8_0, float32 -> f32; flash attention on); default: --kv-cache-dtype "
        "alone, against llama.cpp's default cache",
    )
    p.add_argument(
        "--llama-cache-types",
        default=None,
        metavar="TYPE,TYPE,...",
        help="llama.cpp's cache types, each its own column (q8_0 alone, say, to skip the f16 "
        "run; none: Tandem's KV dtypes alone, as when llama.cpp's prefill of a long prompt "
        "takes too long; default: those of the --kv-cache-dtypes' widths)",
    )
    p.add_argument(
        "--shared-prompt",
        action="store_true",
        help="the B requests of a batch share one prompt, prefilled once on both sides "
        "(llama.cpp's -pps): 1/B of the prefill at long prompts, but the decode then reads one "
        "copy of the prompt's KV (default: B prompts)",
    )
    p.add_argument(
        "--prompt-len",
        dest="prompt_lens",
        type=token_counts,
        default=[128],
        metavar="N[,N,...]",
        help="prompt tokens per request, or several lengths, each its rows (default 128)",
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
    """Every prompt length in turn, its sides alternating round by round; one table of all."""
    from tandem.bench import llamacpp_decode
    from tandem.bench.measure import replace_args

    if args.output_len < 2:
        raise ValueError(
            "--output-len must be at least 2 (one token from the prompt, then decode steps)"
        )
    tool = (
        None
        if args.llama_cache_types == "none"
        else llama_cpp_tool("llama-batched-bench", args.llama_batched_bench)
    )
    gguf = model_gguf(args.model)
    llamacpp_decode.kv_dtypes(args)  # refused before any run
    llamacpp_decode.check_context(args.model, max(args.prompt_lens), args.output_len)
    reports = [
        llamacpp_decode.compare(replace_args(args, prompt_len=n), gguf, tool)
        for n in args.prompt_lens
    ]
    llamacpp_decode.print_table(*reports)
    return {"runs": reports}
