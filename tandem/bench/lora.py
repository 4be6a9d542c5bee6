"""`tandem bench lora`: offline output tokens/s with 1, 8 and 64 distinct LoRA adapters (random
ones, written as PEFT folders for the model) at each rank, the requests spread over them
round-robin, against the base model alone, in one run; and the memory one resident adapter
takes. Each rank runs in its own process (its adapters' memory its own)."""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from tandem.bench.measure import in_subprocess, replace_args
from tandem.bench.offline_runs import ENGINE_OPTIONS, make_requests
from tandem.config.args import add_engine_arguments, given
from tandem.config.option import parse_size

_PEFT = "base_model.model.model.layers.{}.{}.{}.lora_{}.weight"
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
        "--adapters", default="1,8,64", help="distinct adapters per run (default 1,8,64)"
    )
    p.add_argument("--ranks", default="8,16,64", help="adapter ranks (default 8,16,64)")
    p.add_argument(
        "--max-adapter-bytes",
        default=4 << 30,
        type=parse_size,
        help="skip a run whose adapters take more host memory than this (default 4GiB)",
    )
    p.add_argument("--seed", type=int, default=0, help="request seed (default 0)")
    p.add_argument("--json", help="write the results here as JSON")
    p.add_argument("--progress", action="store_true", help="progress bars")


def write_adapter(folder: Path, cfg, rank: int, seed: int) -> None:
    """A random LoRA adapter of every attention and MLP projection, as PEFT saves one."""
    import torch
    from safetensors.torch import save_file

    from tandem.models.lora.adapter import PARTS, part_shapes

    g = torch.Generator().manual_seed(seed)
    shapes = part_shapes(cfg)
    tensors = {}
    for layer in range(cfg.num_layers):
        for parent, names in _TARGETS.items():
            for name in names:
                fused, part = PARTS[name]
                fan_in, widths = shapes[fused]
                a = torch.randn(rank, fan_in, generator=g) / fan_in**0.5
                b = torch.randn(widths[part], rank, generator=g) * 0.01
                tensors[_PEFT.format(layer, parent, name, "A")] = a
                tensors[_PEFT.format(layer, parent, name, "B")] = b
    folder.mkdir(parents=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    targets = [n for names in _TARGETS.values() for n in names]
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": targets}
    (folder / "adapter_config.json").write_text(json.dumps(config))


def run_rank(args, requests) -> dict:
    """One LLM for `args.rank` (None: the base, LoRA off): output tok/s per adapter count."""
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
    out: dict = {}
    with tempfile.TemporaryDirectory() as root:
        loras = []
        if args.rank:
            cfg = ModelConfig.from_hf(load_config(resolve_model(args.model)))
            for i in range(max(counts)):
                write_adapter(Path(root) / str(i), cfg, args.rank, i)
                loras.append(LoRARequest(f"a{i}", i + 1, str(Path(root) / str(i))))
                llm.engine.add_lora(loras[-1])
            manager = llm.engine.core.executor.lora
            out["bytes_per_adapter"] = next(iter(manager.cpu.values())).nbytes
        for n in counts:
            picks = [loras[i % n] for i in range(len(prompts))] if n else [None] * len(prompts)
            warm = SamplingParams(max_tokens=2, ignore_eos=True)  # each adapter made resident
            llm.generate(prompts[: max(n, 1)], warm, lora_request=picks[: max(n, 1)])
            start = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=args.progress, lora_request=picks)
            seconds = time.perf_counter() - start
            tokens = sum(len(o.outputs[0].token_ids) for o in outs)
            out[str(n)] = tokens / seconds
    return out


def main(args: argparse.Namespace) -> None:
    from tandem.models.config import ModelConfig
    from tandem.models.loader.model_files import load_config, resolve_model
    from tandem.models.lora.adapter import part_shapes

    cfg = ModelConfig.from_hf(load_config(resolve_model(args.model)))
    requests = make_requests(args, cfg.vocab_size)
    counts = [int(n) for n in args.adapters.split(",")]
    base = in_subprocess(run_rank, replace_args(args, rank=None, counts=[]), requests)["0"]
    # parameters per unit of rank: A [r per part, in], B block-diagonal [out, r per part]
    per_param = sum((f + sum(w)) * len(w) for f, w in part_shapes(cfg).values()) * cfg.num_layers
    results = {"base": base, "ranks": {}}
    print(f"base alone: {base:.1f} output tok/s ({len(requests)} requests)")
    print(f"{'rank':>5} {'adapters':>9} {'tok/s':>9} {'vs base':>8} {'MiB/adapter':>12}")
    for rank in [int(r) for r in args.ranks.split(",")]:
        fp32 = per_param * rank * 4  # the host copy; a resident one in the model's dtype too
        fit = [n for n in counts if 2 * n * fp32 <= args.max_adapter_bytes]
        if not fit:
            continue
        run = in_subprocess(run_rank, replace_args(args, rank=rank, counts=fit), requests)
        results["ranks"][rank] = run
        for n in fit:
            mib = run["bytes_per_adapter"] / 2**20
            print(f"{rank:>5} {n:>9} {run[str(n)]:>9.1f} {run[str(n)] / base:>8.2f} {mib:>12.1f}")
        for n in set(counts) - set(fit):
            print(f"{rank:>5} {n:>9} skipped: over --max-adapter-bytes")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
