"""`tandem bench offline`: N requests with random prompt and output lengths (ignore_eos),
output tokens/s, peak memory, time per step phase and the gap between steps (the executor
idle while the engine schedules and processes outputs). `--compare hf` runs transformers'
batched generate on the same requests in the same run; `--compare-async` runs tandem with and
without async scheduling (overlap). Each run has its own process, so peak RSS is its own."""

from __future__ import annotations

import argparse
import json

from tandem.bench.measure import in_subprocess, replace_args
from tandem.bench.offline_runs import ENGINE_OPTIONS, make_requests, run_hf, run_tandem
from tandem.bench.quantization import compare
from tandem.config.args import add_engine_arguments


def _print_run(t: dict) -> None:
    print(
        f"tandem (async scheduling {'on' if t['async_scheduling'] else 'off'}"
        f"{', deterministic' if t['deterministic'] else ''}): {t['output_tokens']} tokens "
        f"in {t['seconds']:.1f}s = {t['output_throughput']:.1f} tok/s "
        f"({t['dtype']}, peak RSS {t['peak_rss_mb']:.0f} MiB)"
    )
    ms = t["ms_per_step"]
    print(
        f"        {t['steps']} steps; per step: schedule {ms['schedule']:.2f} ms, "
        f"execute {ms['execute']:.2f} ms "
        f"(input building {ms['prepare']:.2f} ms), update {ms['update']:.2f} ms; "
        f"gap between steps {ms['gap']:.3f} ms ({t['gap_share_of_execute']:.2%} of execute)"
    )
    print(
        f"        KV utilisation (tokens / capacity of blocks held) "
        f"mean {t['kv_utilization_mean']:.1%}, "
        f"peak pool usage {t['kv_usage_peak']:.1%}, {t['preemptions']} preemptions"
    )
    if t.get("spec_decode"):
        sd = t["spec_decode"]
        print(
            f"        speculative decoding: acceptance rate {sd['acceptance_rate']:.1%}, "
            f"mean accepted length {sd['mean_accepted_length']:.2f} tokens per verify step "
            f"({sd['num_drafts']} verify steps)"
        )


def _print_async_table(off: dict, on: dict) -> None:
    rows = [
        ("output tok/s", "output_throughput", None, ".1f"),
        ("steps", "steps", None, "d"),
        ("execute ms/step", "ms_per_step", "execute", ".2f"),
        ("input building ms/step", "ms_per_step", "prepare", ".2f"),
        ("schedule ms/step", "ms_per_step", "schedule", ".3f"),
        ("update ms/step", "ms_per_step", "update", ".3f"),
        ("gap ms/step", "ms_per_step", "gap", ".3f"),
        ("gap % of execute", "gap_share_of_execute", None, ".2%"),
        ("peak RSS MiB", "peak_rss_mb", None, ".0f"),
    ]
    print(f"{'':24} {'sync':>10} {'async':>10} {'async/sync':>11}")
    for label, key, sub, fmt in rows:
        a, b = off[key], on[key]
        if sub:
            a, b = a[sub], b[sub]
        ratio = f"{b / a:.2f}x" if a else "-"
        print(f"{label:24} {a:>10{fmt}} {b:>10{fmt}} {ratio:>11}")


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_engine_arguments(p, ENGINE_OPTIONS, store_defaults=True)
    p.add_argument("--num-prompts", type=int, default=64, help="requests to run (default 64)")
    p.add_argument(
        "--min-prompt", type=int, default=64, help="shortest random prompt, tokens (default 64)"
    )
    p.add_argument(
        "--max-prompt", type=int, default=512, help="longest random prompt, tokens (default 512)"
    )
    p.add_argument(
        "--min-output", type=int, default=64, help="fewest output tokens per request (default 64)"
    )
    p.add_argument(
        "--max-output", type=int, default=256, help="most output tokens per request (default 256)"
    )
    p.add_argument(
        "--compare-async",
        action="store_true",
        help="run tandem with and without async scheduling, side by side",
    )
    p.add_argument(
        "--compare-deterministic",
        action="store_true",
        help="--quantization: each precision with and without --deterministic, alternating, "
        "and the ratio",
    )
    p.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    p.add_argument(
        "--seed", type=int, default=0, help="seed of the random prompts and lengths (default 0)"
    )
    p.add_argument(
        "--compare",
        choices=["hf"],
        default=None,
        help="also run Hugging Face transformers on the same requests, side by side "
        "(default: tandem alone)",
    )
    p.add_argument(
        "--hf-batch-size",
        type=int,
        default=32,
        help="--compare hf: requests per transformers generate() call (default 32)",
    )
    p.add_argument(
        "--hf-dtype", default=None, help="transformers' dtype (default: the same as --dtype)"
    )
    p.add_argument(
        "--json",
        dest="json_path",
        default=None,
        help="also write every figure as JSON to this path",
    )
    p.add_argument(
        "--quantization",
        default=None,
        help="comma-separated precisions (bf16,int8,int4): decode tok/s of each at --batch-sizes "
        "(see bench/quantization.py) instead of the run above",
    )
    p.add_argument(
        "--batch-sizes",
        default="1,8,32,64",
        help="--quantization: comma-separated batch sizes; the KV pool is sized for the "
        "largest unless --kv-cache-memory (default 1,8,32,64)",
    )
    p.add_argument(
        "--prompt-len",
        type=int,
        default=128,
        help="--quantization: prompt tokens per request (default 128)",
    )
    p.add_argument(
        "--output-len",
        type=int,
        default=128,
        help="--quantization: output tokens per request (default 128)",
    )
    p.add_argument(
        "--repeats", type=int, default=1, help="--quantization: rounds, alternating; best kept"
    )


# The options only one of the two runs reads (--quantization's precision table, or the request
# run): one given to the other run is refused in words, not ignored.
_TABLE_ONLY = (
    "batch_sizes",
    "prompt_len",
    "output_len",
    "repeats",
    "compare_deterministic",
)
_RUN_ONLY = (
    "num_prompts",
    "min_prompt",
    "max_prompt",
    "min_output",
    "max_output",
    "max_num_seqs",
    "max_num_batched_tokens",
    "enforce_eager",
    "async_scheduling",
    "compare_async",
    "compare",
    "hf_batch_size",
    "hf_dtype",
    "speculative_config",
)


def _refuse_the_other_runs_options(args: argparse.Namespace) -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    defaults = vars(parser.parse_args([]))
    others = _RUN_ONLY if args.quantization else _TABLE_ONLY
    named = [
        "--" + name.replace("_", "-")
        for name in others
        if getattr(args, name) != defaults.get(name)
    ]
    if named:
        raise SystemExit(
            f"bench offline: {', '.join(named)}: "
            + (
                "read by the request run only, not by --quantization's precision table"
                if args.quantization
                else "read by --quantization's precision table only "
                "(add --quantization, or leave them out)"
            )
        )


def main(args: argparse.Namespace) -> dict:
    _refuse_the_other_runs_options(args)
    if args.quantization:
        report = compare(args)
        if args.json_path:
            with open(args.json_path, "w") as f:
                json.dump(report, f, indent=2)
        return report
    from tandem.models.config import ModelConfig
    from tandem.models.loader.model_files import load_config, resolve_model

    vocab = ModelConfig.from_hf(load_config(resolve_model(args.model))).vocab_size
    requests = make_requests(args, vocab)
    report = {"config": {k: v for k, v in vars(args).items() if k not in ("func", "json_path")}}
    if args.compare_async:  # without overlap first, then with it ("tandem")
        off = report["tandem_sync"] = in_subprocess(
            run_tandem, replace_args(args, async_scheduling=False), requests
        )
        _print_run(off)
        args = replace_args(args, async_scheduling=True)
    t = report["tandem"] = in_subprocess(run_tandem, args, requests)
    _print_run(t)
    if args.compare_async:
        report["ratio_async"] = t["output_throughput"] / off["output_throughput"]
        _print_async_table(off, t)
    if args.compare == "hf":
        h = report["hf"] = in_subprocess(run_hf, args, requests)
        report["ratio"] = t["output_throughput"] / h["output_throughput"]
        print(
            f"hf:     {h['output_tokens']} tokens in {h['seconds']:.1f}s = "
            f"{h['output_throughput']:.1f} tok/s "
            f"({h['dtype']}, batch {h['batch_size']}, peak RSS {h['peak_rss_mb']:.0f} MiB)"
        )
        print(f"ratio tandem/hf: {report['ratio']:.2f}x")
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump(report, f, indent=2)
    return report
