"""`tandem bench gpu`: what a GPU machine is checked for, in one run, written to one JSON file.

1. Greedy equality with transformers (fp32, on the device) for the given model and a tiny
   random GQA Llama: a mixed batch, chunked prefill with preemption, prefix-cache hits; with
   CUDA graphs on and off.
2. Offline throughput (each run in its own process): tandem with graphs on and off against
   transformers' batched generate, on the same requests and device.
3. Decode step time at the given batch sizes, graphs on and off, beside the bandwidth
   roofline: (weight bytes + KV bytes read) per step / step time, against --peak-bandwidth.
4. A torch.profiler table of decode steps at the largest batch: where the time goes.

`--tiny` shrinks every part (a dry run on CPU takes seconds; scripts/gpu_check.sh wraps the
real one)."""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

from tandem.bench import offline_runs
from tandem.bench.gpu_decode import decode_steps
from tandem.bench.gpu_equality import check_equality
from tandem.bench.measure import in_subprocess, replace_args
from tandem.config.args import add_engine_arguments


def _tiny_model(folder: Path) -> str:
    """A random 2-layer GQA Llama (4 query heads over 2 KV heads, head_dim 32)."""
    import torch
    import transformers as tf

    torch.manual_seed(0)
    config = tf.LlamaConfig(
        vocab_size=512,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        initializer_range=0.3,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    tf.AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(folder)
    return str(folder)


def _environment(args) -> dict:
    import torch
    import transformers

    env = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "device": args.device,
        "model": args.model,
    }
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name()
    return env


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", required=True, help="folder for gpu_check.json")
    # The GPU check: on CUDA, throughput and decode timed in bf16 (equality runs in fp32 whatever
    # --dtype says), over a fixed KV pool so that runs on different cards compare.
    add_engine_arguments(
        p,
        ("model", "device", "dtype", "kv_cache_memory"),
        store_defaults=True,
        defaults={"device": "cuda", "dtype": "bfloat16", "kv_cache_memory": 16 << 30},
    )
    p.add_argument(
        "--tiny", action="store_true", help="a dry run: tiny model and workload (seconds on CPU)"
    )
    p.add_argument(
        "--peak-bandwidth", type=float, default=4.3e12, help="bytes/s (H200 device copy: 4.3e12)"
    )
    p.add_argument(
        "--decode-prompt",
        type=int,
        default=256,
        help="context of each request when decode is timed",
    )
    p.add_argument(
        "--decode-steps",
        type=int,
        default=30,
        help="decode steps timed per batch size (default 30)",
    )
    p.add_argument(
        "--skip", default="", help="comma list of parts to skip: equality,offline,decode"
    )


def main(args: argparse.Namespace) -> dict:
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    skip = set(filter(None, args.skip.split(",")))
    tmp = tempfile.TemporaryDirectory()
    if args.tiny:
        args.model = _tiny_model(Path(tmp.name) / "tiny-main")
        args.kv_cache_memory, args.decode_prompt, args.decode_steps = 64 << 20, 16, 4
    from tandem.models.config import ModelConfig
    from tandem.models.loader.model_files import load_config, resolve_model

    model_dir = str(resolve_model(args.model))
    vocab = ModelConfig.from_hf(load_config(model_dir)).vocab_size
    report: dict = {"environment": _environment(args)}

    def part(name: str, fn):
        if name in skip:
            return
        t0 = time.perf_counter()
        report[name] = fn()
        report.setdefault("seconds", {})[name] = time.perf_counter() - t0
        print(
            f"== {name} ({report['seconds'][name]:.1f} s)\n"
            f"{json.dumps(report[name], indent=1)[:6000]}",
            flush=True,
        )
        (out_dir / "gpu_check.json").write_text(
            json.dumps(report, indent=2)
        )  # what is done so far survives

    n_eq, new_eq = (4, 6) if args.tiny else (8, 24)
    part(
        "equality",
        lambda: {
            "model": check_equality(args.model, args.device, new_eq, n_eq, vocab),
            "tiny_llama": check_equality(
                _tiny_model(Path(tmp.name) / "tiny-eq"), args.device, new_eq, n_eq, 512
            ),
        },
    )
    wl = (
        dict(num_prompts=8, min_prompt=8, max_prompt=32, min_output=8, max_output=16)
        if args.tiny
        else dict(num_prompts=256, min_prompt=128, max_prompt=512, min_output=128, max_output=256)
    )
    oargs = argparse.Namespace(
        model=args.model,
        dtype=args.dtype,
        kv_cache_dtype="auto",
        device=args.device,
        seed=0,
        max_num_seqs=256,
        max_num_batched_tokens=8192,
        kv_cache_memory=args.kv_cache_memory,
        progress=False,
        hf_dtype=None,
        hf_batch_size=256,
        enforce_eager=False,
        **wl,
    )
    requests = offline_runs.make_requests(oargs, vocab)

    def throughput() -> dict:
        eager = replace_args(oargs, enforce_eager=True)
        runs = {
            "tandem_graphs": in_subprocess(offline_runs.run_tandem, oargs, requests),
            "tandem_eager": in_subprocess(offline_runs.run_tandem, eager, requests),
            "hf_generate": in_subprocess(offline_runs.run_hf, oargs, requests),
        }
        runs["workload"] = {
            **wl,
            "max_num_seqs": oargs.max_num_seqs,
            "max_num_batched_tokens": oargs.max_num_batched_tokens,
            "dtype": args.dtype,
            "hf_batch_size": oargs.hf_batch_size,
        }
        runs["ratio_vs_hf"] = (
            runs["tandem_graphs"]["output_throughput"] / runs["hf_generate"]["output_throughput"]
        )
        runs["ratio_graphs_vs_eager"] = (
            runs["tandem_graphs"]["output_throughput"] / runs["tandem_eager"]["output_throughput"]
        )
        return runs

    part("offline", throughput)
    batches = [1, 4] if args.tiny else [1, 64, 256]
    part(
        "decode",
        lambda: {
            "graphs": decode_steps(args, batches, eager=False, profile=True),
            "eager": decode_steps(args, batches, eager=True, profile=False),
        },
    )
    tmp.cleanup()
    print(f"wrote {out_dir / 'gpu_check.json'}")
    return report


# scripts/gpu_check.sh: without the CLI, which imports every command's module
if __name__ == "__main__":
    import logging

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    parser = argparse.ArgumentParser(prog="tandem bench gpu", description=__doc__.split("\n")[0])
    add_arguments(parser)
    main(parser.parse_args())
