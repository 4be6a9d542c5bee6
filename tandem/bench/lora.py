"""`tandem bench lora`: offline output tokens/s with a number of distinct LoRA adapters (random
ones, written as PEFT folders for the model) at a rank, the requests spread over them
round-robin, against the base model alone, in one run; and the memory a resident adapter takes,
measured from the tensors held and from the process's RSS growth. The default runs are 1, 8 and
64 adapters at ranks 8 and 64, and the goal row: 8 adapters at rank 16, at >= 0.8x the base.
Each rank runs in its own process (its adapters' memory its own)."""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

from tandem.bench.measure import in_subprocess, replace_args
from tandem.bench.offline_runs import ENGINE_OPTIONS, make_requests
from tandem.config.args import add_engine_arguments, given
from tandem.config.option import parse_size

_PEFT = "base_model.model.model.layers.{}.{}.{}.lora_{}.weight"
_RUNS = "8:1,8:8,8:64,16:8,64:1,64:8,64:64"
_GOAL = (16, 8, 0.8)  # rank, adapters, the least share of the base's throughput
_TARGETS = {
    "self_attn": ("q_proj", "k_proj", "v_proj", "o_proj"),
    "mlp": ("gate_proj", "up_proj", "down_proj"),
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_engine_arguments(p, ENGINE_OPTIONS, store_defaults=True)
    p.add_argument("--num-prompts", type=int, default=64, help="requests per run (default 64)")
    p.add_argument("--min-prompt", type=int, default=32, help="shortest prompt (default 32)")
    p.add_argument("--max-prompt", type=int, default=128, help="longest prompt (default 128)")
    p.add_argument("--min-output", type=int, default=32, help="fewest output tokens (default 32)")
    p.add_argument("--max-output", type=int, default=64, help="most output tokens (default 64)")
    p.add_argument(
        "--runs",
        default=_RUNS,
        help=f"runs as rank:adapters, comma-separated (default {_RUNS})",
    )
    p.add_argument(
        "--max-adapter-bytes",
        default=6 << 30,
        type=parse_size,
        help="skip a run whose adapters take more host memory than this (default 6GiB)",
    )
    p.add_argument("--seed", type=int, default=0, help="request seed (default 0)")
    p.add_argument("--json", help="write the results here as JSON")
    p.add_argument("--progress", action="store_true", help="progress bars")


def write_adapter(folder: Path, cfg, rank: int, seed: int) -> None:
    """A random LoRA adapter of every projection the base serves adapters on, as PEFT saves
    one."""
    import torch
    from safetensors.torch import save_file

    from tandem.models.lora.adapter import PARTS, served_modules

    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, (fan_in, widths) in served_modules(cfg).items():
        layer, fused = name.split(".", 2)[1:]
        for module in (m for m, (f, _) in PARTS.items() if f == fused):
            a = torch.randn(rank, fan_in, generator=g) / fan_in**0.5
            b = torch.randn(widths[PARTS[module][1]], rank, generator=g) * 0.01
            key = f"base_model.model.model.layers.{layer}.{fused.split('.')[0]}.{module}"
            tensors[f"{key}.lora_A.weight"], tensors[f"{key}.lora_B.weight"] = a, b
    folder.mkdir(parents=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(PARTS)}
    (folder / "adapter_config.json").write_text(json.dumps(config))


def _rss() -> int | None:
    """This process's resident set in bytes (Linux), else None."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return None


def run_rank(args, requests) -> dict:
    """One LLM for `args.rank` (None: the base, LoRA off): output tok/s per adapter count, and
    the memory per resident adapter with all of them resident (`held`: bytes of the adapters'
    tensors per device type; `rss`: the process's growth, host copies and any allocator slack)."""
    from tandem import LLM, LoRARequest, SamplingParams
    from tandem.models.config import ModelConfig
    from tandem.models.loader.model_files import load_config, resolve_model

    counts = list(args.counts) if args.rank else [0]
    lora = {}
    if args.rank:
        lora = dict(enable_lora=True, max_loras=max(counts), max_lora_rank=args.rank)
    llm = LLM(**given(args, ENGINE_OPTIONS), **lora)
    params = [SamplingParams(temperature=0, max_tokens=o, ignore_eos=True) for _, o in requests]
    prompts = [p for p, _ in requests]
    warm = SamplingParams(max_tokens=2, ignore_eos=True)
    llm.generate(prompts[:1], warm)
    out: dict = {}
    with tempfile.TemporaryDirectory() as root:
        loras = []
        if args.rank:
            cfg = ModelConfig.from_hf(load_config(resolve_model(args.model)))
            for i in range(max(counts)):
                write_adapter(Path(root) / str(i), cfg, args.rank, i)
                loras.append(LoRARequest(f"a{i}", i + 1, str(Path(root) / str(i))))
            before = _rss()
            for lora_request in loras:
                llm.engine.add_lora(lora_request)
            prompts_all = [prompts[i % len(prompts)] for i in range(len(loras))]
            llm.generate(prompts_all, warm, lora_request=loras)  # every adapter made resident
            after = _rss()
            held = llm.engine.core.executor.lora.held_bytes()
            out["held"] = {device: n / len(loras) for device, n in held.items()}
            out["rss"] = None if before is None or after is None else (after - before) / len(loras)
        for n in counts:
            picks = [loras[i % n] for i in range(len(prompts))] if n else [None] * len(prompts)
            llm.generate(prompts[: max(n, 1)], warm, lora_request=picks[: max(n, 1)])
            start = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=args.progress, lora_request=picks)
            seconds = time.perf_counter() - start
            tokens = sum(len(o.outputs[0].token_ids) for o in outs)
            out[str(n)] = tokens / seconds
    return out


def parse_runs(text: str) -> dict[int, list[int]]:
    """ "8:1,8:8,16:8" -> {8: [1, 8], 16: [8]}."""
    runs: dict[int, list[int]] = {}
    for item in text.split(","):
        rank, colon, count = item.strip().partition(":")
        if not colon or not rank.isdigit() or not count.isdigit():
            raise ValueError(f"a run is rank:adapters, got {item!r}")
        runs.setdefault(int(rank), []).append(int(count))
    return runs


def main(args: argparse.Namespace) -> None:
    from tandem.models.config import ModelConfig
    from tandem.models.loader.model_files import load_config, resolve_model
    from tandem.models.lora.adapter import served_modules

    cfg = ModelConfig.from_hf(load_config(resolve_model(args.model)))
    requests = make_requests(args, cfg.vocab_size)
    base = in_subprocess(run_rank, replace_args(args, rank=None, counts=[]), requests)["0"]
    # parameters per unit of rank: A [r per part, in], B [out of each part, r]
    per_rank = sum(f * len(w) + sum(w) for f, w in served_modules(cfg).values())
    results: dict = {"base": base, "ranks": {}}
    print(f"base alone: {base:.1f} output tok/s ({len(requests)} requests)")
    head = ("rank", 5), ("adapters", 9), ("tok/s", 9), ("vs base", 8), ("MiB/adapter", 12)
    print(" ".join(f"{h:>{w}}" for h, w in head), f"{'RSS MiB':>8}")
    for rank, counts in parse_runs(args.runs).items():
        fit = [n for n in counts if n * per_rank * rank * 4 <= args.max_adapter_bytes]
        for n in sorted(set(counts) - set(fit)):
            print(f"{rank:>5} {n:>9} skipped: over --max-adapter-bytes")
        if not fit:
            continue
        run = in_subprocess(run_rank, replace_args(args, rank=rank, counts=fit), requests)
        results["ranks"][rank] = run
        held = sum(run["held"].values()) / 2**20
        rss = "-" if run["rss"] is None else f"{run['rss'] / 2**20:.1f}"
        for n in fit:
            tok = run[str(n)]
            print(f"{rank:>5} {n:>9} {tok:>9.1f} {tok / base:>8.2f} {held:>12.1f} {rss:>8}")
    rank, n, least = _GOAL
    if str(n) in results["ranks"].get(rank, {}):
        share = results["ranks"][rank][str(n)] / base
        verdict = "met" if share >= least else "not met"
        print(f"goal: {n} adapters of rank {rank} at >= {least}x the base: {share:.2f}x, {verdict}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
