"""`tandem bench llamacpp` (decode): Tandem's decode tok/s against llama.cpp's
`llama-batched-bench` on the same GGUF, threads, batch sizes and prompt lengths.

Both sides prefill B random prompts of `--prompt-len` tokens and then time the decode steps
only: llama.cpp as its S_TG column (B x ntg over the ntg decode steps after its prompt phase),
with ntg = output_len - 1; Tandem as `bench offline --quantization` does (bench/quantization.py:
B x (output_len - 1) tokens over the time after every request has its first token), each prompt
first prefilled alone so that the B requests find theirs in the prefix cache and decode in step
from the first token on, however long the prompts. `--kv-cache-dtypes` adds a KV axis: each
Tandem KV dtype a column, and llama.cpp with the matching `-ctk/-ctv` type (flash attention on,
which llama.cpp's quantised V cache needs). `--shared-prompt` gives a batch's requests one
prompt, prefilled once on both sides (llama.cpp's -pps). Every side runs in a fresh process,
the order rotating by one each round, for `--repeats` rounds; each figure keeps its best, which
is what a shared, noisy machine allows.
"""

from __future__ import annotations

import argparse
import subprocess
from pathlib import Path

LLAMA = "llama.cpp"
# Tandem's KV cache dtype -> llama.cpp's cache type of the same width (its 2-byte type is f16)
LLAMA_KV_TYPES = {
    "auto": "f16",
    "bfloat16": "f16",
    "float16": "f16",
    "float32": "f32",
    "int8": "q8_0",
}


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


def batched_bench_command(
    tool: Path, gguf: Path, args: argparse.Namespace, kv_type: str | None = None
) -> list[str]:
    """One llama-batched-bench run of every batch size at args.prompt_len; `kv_type`: its K and V
    cache type (with flash attention on), else llama.cpp's defaults."""
    batches = [int(b) for b in args.batch_sizes.split(",")]
    n_kv = max(batches) * (args.prompt_len + args.output_len)
    cache = [] if kv_type is None else ["-ctk", kv_type, "-ctv", kv_type, "-fa", "on"]
    shared = ["-pps"] if args.shared_prompt else []
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
        *cache,
        *shared,
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


def kv_dtypes(args: argparse.Namespace) -> list[str] | None:
    """--kv-cache-dtypes, checked; None when not given (one KV dtype, llama.cpp's default)."""
    if not args.kv_cache_dtypes:
        return None
    names = [n.strip() for n in args.kv_cache_dtypes.split(",")]
    unknown = [n for n in names if n not in LLAMA_KV_TYPES]
    if unknown or len(set(names)) != len(names):
        raise ValueError(
            f"--kv-cache-dtypes {args.kv_cache_dtypes!r}: give distinct ones of "
            f"{', '.join(LLAMA_KV_TYPES)}"
        )
    return names


def llama_cache_types(args: argparse.Namespace, kvs: list[str] | None) -> list[str | None]:
    """llama.cpp's cache types: --llama-cache-types (none: no llama.cpp run), else those of the
    Tandem KV dtypes' widths, else [None] (its default, no -ctk/-ctv)."""
    if args.llama_cache_types == "none":
        return []
    if args.llama_cache_types:
        return [t.strip() for t in args.llama_cache_types.split(",")]
    return list(dict.fromkeys(LLAMA_KV_TYPES[kv] for kv in kvs)) if kvs else [None]


def check_context(model: str, prompt_len: int, output_len: int) -> None:
    """Refuse a prompt and output longer than the model's config allows: Tandem would refuse
    the request, while llama.cpp runs on past its trained context."""
    from tandem.models.config import ModelConfig
    from tandem.models.loader.model_files import load_config, resolve_model

    limit = ModelConfig.from_hf(load_config(resolve_model(model))).max_context_len
    if prompt_len + output_len > limit:
        raise ValueError(
            f"--prompt-len {prompt_len} + --output-len {output_len} exceeds the {limit} "
            f"positions {model}'s config allows; give at most {limit - output_len}"
        )


def _tandem_args(args: argparse.Namespace, kv_cache_dtype: str) -> argparse.Namespace:
    """What bench/quantization.run_precision reads."""
    return argparse.Namespace(
        model=args.model,
        dtype=args.dtype,
        kv_cache_dtype=kv_cache_dtype,
        device="cpu",
        batch_sizes=args.batch_sizes,
        prompt_len=args.prompt_len,
        output_len=args.output_len,
        kv_cache_memory=args.kv_cache_memory,
        num_threads=args.num_threads,
        seed=args.seed,
    )


def compare(args: argparse.Namespace, gguf: Path, tool: Path | None) -> dict:
    """Every side (each Tandem precision at each KV dtype, then llama.cpp at each of their cache
    types) at args.prompt_len for `repeats` rounds, the order rotating by one each round; each
    figure keeps its best."""
    from tandem.bench.measure import in_subprocess
    from tandem.bench.quantization import RunPrecision

    kvs = kv_dtypes(args)
    batches = [int(b) for b in args.batch_sizes.split(",")]
    # side: (precision, KV dtype) for Tandem, (LLAMA, cache type or None) for llama.cpp
    tandem = [(p, kv) for p in args.quantization.split(",") for kv in kvs or [args.kv_cache_dtype]]
    llama_types = llama_cache_types(args, kvs)
    sides = tandem + [(LLAMA, t) for t in llama_types]
    commands = {t: batched_bench_command(tool, gguf, args, t) for t in llama_types} if tool else {}
    best = {side: dict.fromkeys(batches, 0.0) for side in sides}
    peak_rss_mb: dict[tuple, float] = {}
    served: dict[tuple, str] = {}  # side -> the precision it ran ("auto" resolves to the file's)
    kv_served: dict[tuple, str] = {}
    for round_ in range(args.repeats):
        for side in sides[round_ % len(sides) :] + sides[: round_ % len(sides)]:
            name, kv = side
            if name == LLAMA:
                got = run_llama(commands[kv], batches)
            else:
                run_side = RunPrecision(name, prefill="shared" if args.shared_prompt else "alone")
                run = in_subprocess(run_side, _tandem_args(args, kv), None)
                got, peak_rss_mb[side], served[side] = (
                    run["decode_tok_s"],
                    run["peak_rss_mb"],
                    run["precision"],
                )
                kv_served[side] = run["kv_cache_dtype"]
            print(
                f"prompt {args.prompt_len}, round {round_ + 1}, {_label(side, served, kvs)}: "
                + ", ".join(f"B={b} {got[b]:.1f}" for b in batches)
            )
            best[side] = {b: max(best[side][b], got[b]) for b in batches}
    label = {side: _label(side, served, kvs) for side in sides}

    # each Tandem side against llama.cpp with the same KV width, where that ran
    paired = {
        s: (LLAMA, None) if llama_types == [None] else (LLAMA, LLAMA_KV_TYPES[s[1]]) for s in tandem
    }
    paired = {s: llama for s, llama in paired.items() if llama in best}

    return {
        "model": str(gguf),
        "prompt_len": args.prompt_len,
        "shared_prompt": args.shared_prompt,
        "llama_commands": [" ".join(c) for c in commands.values()],
        "decode_tok_s": {label[side]: best[side] for side in sides},
        "ratio": {
            label[s]: {b: best[s][b] / best[llama][b] for b in batches}
            for s, llama in paired.items()
        },
        "ratio_against": {label[s]: label[llama] for s, llama in paired.items()},
        # each KV dtype after the first against the first, at the same precision
        "kv_ratio": {
            f"{label[(p, kv)]} / {kvs[0]}": {
                b: best[(p, kv)][b] / best[(p, kvs[0])][b] for b in batches
            }
            for p, kv in tandem
            if kvs and kv != kvs[0]
        },
        "tandem_peak_rss_mb": {label[side]: rss for side, rss in peak_rss_mb.items()},
        "tandem_kv_cache_dtype": {label[side]: kv for side, kv in kv_served.items()},
    }


def _label(side: tuple, served: dict, kvs: list[str] | None) -> str:
    """A side's column name: the precision (with what `auto` ran), and with a KV axis its KV
    dtype; llama.cpp with its cache type."""
    name, kv = side
    if name == LLAMA:
        return LLAMA if kv is None else f"{LLAMA} {kv}"
    ran = served.get(side, name)
    text = name if ran == name else f"{name} ({ran})"
    return text if kvs is None else f"{text} kv {kv}"


def print_table(*reports: dict) -> None:
    """One table of every prompt length's report: a row per prompt length and batch size."""
    first = reports[0]
    sides = list(first["decode_tok_s"])
    heads = [f"tandem {s}" if not s.startswith(LLAMA) else f"{s} S_TG" for s in sides]
    llama_kv = {s.removeprefix(LLAMA).strip() or "f16" for s in sides if s.startswith(LLAMA)}
    ratios = {
        **{f"{s} / {first['ratio_against'][s]}": r for s, r in first["ratio"].items()},
        **{s: r for s, r in first["kv_ratio"].items()},
    }
    print(f"{first['model']}, against:")
    for line in (line for report in reports for line in report["llama_commands"]):
        print(f"  `{line}`")
    if first["shared_prompt"]:
        print("each batch's requests share one prompt (prefilled once, one copy of its KV)")
    widths = [max(15, len(h) + 1) for h in [*heads, *ratios]]
    print(
        "decode tok/s\n"
        + f"{'prompt':>7} {'batch':>5} "
        + " ".join(f"{h:>{w}}" for h, w in zip([*heads, *ratios], widths))
    )
    for report in reports:
        ratio_rows = [*report["ratio"].values(), *report["kv_ratio"].values()]
        for b in report["decode_tok_s"][sides[0]]:
            cells = [f"{report['decode_tok_s'][s][b]:.1f}" for s in sides]
            cells += [f"{r[b]:.2f}x" for r in ratio_rows]
            print(
                f"{report['prompt_len']:>7} {b:>5} "
                + " ".join(f"{c:>{w}}" for c, w in zip(cells, widths))
            )
    rss = {s: max(r["tandem_peak_rss_mb"][s] for r in reports) for s in first["tandem_peak_rss_mb"]}
    print("tandem peak RSS: " + ", ".join(f"{s} {mb:,.0f} MiB" for s, mb in rss.items()))
    print(
        "tandem KV cache: "
        + ", ".join(f"{s} {kv}" for s, kv in first["tandem_kv_cache_dtype"].items())
        + (f" (llama.cpp's: {', '.join(sorted(llama_kv))})" if llama_kv else "")
    )
