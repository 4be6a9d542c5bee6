"""`tandem bench load`: what loading a model costs: the weight file's size, the bytes written to
the cache, the load's peak RSS above the process's baseline (torch and tandem imported), and
the time it takes, for the precision variants an engine would build (the default: auto).

Two phases, each in a fresh process whose baseline is taken once torch and tandem's modules are
imported: resolving the model (a GGUF's config and tokenizer written into the cache, once; into
a fresh temporary cache unless --cache is given) and building its variants (the weights read
into their serving form; the KV pool is not part of it). Peak RSS is the kernel's mark
(VmHWM, reset through /proc/self/clear_refs), so Linux only.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tandem.config.args import add_engine_arguments, given

ENGINE_OPTIONS = ("model", "quantization", "dtype")


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_engine_arguments(p, ENGINE_OPTIONS, store_defaults=True)
    p.add_argument(
        "--cache", default=None, help="the cache directory (default: a fresh temporary one)"
    )
    p.add_argument(
        "--json", dest="json_path", default=None, help="also write the figures as JSON to this path"
    )
    p.add_argument(
        "--phase", choices=["resolve", "load"], default=None, help=argparse.SUPPRESS
    )  # a child's


def _rss() -> tuple[int, int]:
    """(VmRSS, VmHWM) in bytes."""
    fields = dict(
        line.split(":", 1)
        for line in Path("/proc/self/status").read_text().splitlines()
        if ":" in line
    )
    return tuple(int(fields[k].split()[0]) * 1024 for k in ("VmRSS", "VmHWM"))


def _reset_peak() -> int:
    """Return freed heap pages to the OS, reset the peak-RSS mark; returns the RSS then."""
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    Path("/proc/self/clear_refs").write_text("5")
    return _rss()[0]


def _tree_bytes(root: Path) -> int:
    return sum(f.stat().st_size for f in root.rglob("*") if f.is_file()) if root.exists() else 0


def measure(args: argparse.Namespace) -> dict:
    """One phase, in this process: its time and its peak RSS above the baseline."""
    import torch  # noqa: F401  (the baseline includes torch and tandem's modules)

    from tandem.config import EngineConfig, cache_root
    from tandem.executor.attention import TorchAttention
    from tandem.executor.device import resolve_device, resolve_dtype
    from tandem.models.config import ModelConfig
    from tandem.models.loader.model_files import (
        gguf_source,
        load_config,
        resolve_model,
        weight_source,
    )
    from tandem.models.loader.variants import build_variants

    config = EngineConfig.from_kwargs(**given(args, ENGINE_OPTIONS))
    if args.phase == "resolve":
        before = _tree_bytes(cache_root())
        base = _reset_peak()
        start = time.perf_counter()
        resolve_model(args.model)
        return {
            "resolve_s": round(time.perf_counter() - start, 2),
            "resolve_peak_rss_above_baseline": _rss()[1] - base,
            "cache_bytes_written": _tree_bytes(cache_root()) - before,
        }
    model_dir = resolve_model(args.model)
    device = resolve_device(config.device_config.device)
    dtype = resolve_dtype(args.dtype, device)
    cfg = ModelConfig.from_hf(load_config(model_dir))
    base = _reset_peak()
    start = time.perf_counter()
    source = weight_source(model_dir, gguf_source(args.model))
    variants = build_variants(
        config.quant_config, source, args.dtype, cfg, device, dtype, TorchAttention
    )
    load_s = time.perf_counter() - start
    rss, peak = _rss()
    return {
        "precisions": list(variants.models),
        "dtype": str(variants.dtype).removeprefix("torch."),
        "load_s": round(load_s, 2),
        "load_peak_rss_above_baseline": peak - base,
        "held_rss_above_baseline": rss - base,
        "weight_bytes": dict(variants.weight_bytes),
    }


def _phase(args: argparse.Namespace, phase: str, cache: str) -> dict:
    argv = [
        sys.executable,
        __file__,
        "--model",
        args.model,
        "--dtype",
        args.dtype,
        "--phase",
        phase,
    ]
    if args.quantization:
        argv += ["--quantization", args.quantization]
    import tandem  # the children import the same checkout as this process

    env = {
        **os.environ,
        "PYTHONPATH": str(Path(tandem.__file__).parents[1]),
        "TANDEM_CACHE_DIR": cache,
    }
    out = subprocess.run(argv, check=True, stdout=subprocess.PIPE, text=True, env=env).stdout
    return json.loads(out.strip().splitlines()[-1])


def main(args: argparse.Namespace) -> dict:
    if args.phase:  # a child: one phase, its figures as the last line
        report = measure(args)
        print(json.dumps(report))
        return report
    from tandem.bench.report import mib
    from tandem.models.loader.model_files import gguf_source

    source = gguf_source(args.model)  # an alias's file is located (and assembled) before measuring
    with tempfile.TemporaryDirectory(prefix="tandem-bench-load-") as tmp:
        cache = args.cache or tmp  # the children's cache only: this process's stays as it was
        report = {
            "model": args.model,
            **_phase(args, "resolve", cache),
            **_phase(args, "load", cache),
        }
    report["file_bytes"] = (
        source.stat().st_size
        if source is not None
        else sum(f.stat().st_size for f in Path(args.model).glob("*.safetensors"))
    )
    report["peak_over_file"] = round(
        report["load_peak_rss_above_baseline"] / report["file_bytes"], 2
    )
    print(
        f"{report['model']}: file {mib(report['file_bytes'])}, "
        f"cache written {mib(report['cache_bytes_written'])} "
        f"(resolve {report['resolve_s']} s, "
        f"peak +{mib(report['resolve_peak_rss_above_baseline'])}); "
        f"load {'+'.join(report['precisions'])} ({report['dtype']}) {report['load_s']} s, "
        f"peak RSS +{mib(report['load_peak_rss_above_baseline'])} "
        f"({report['peak_over_file']}x the file), "
        f"held +{mib(report['held_rss_above_baseline'])}"
    )
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(report, indent=2) + "\n")
    return report


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    main(parser.parse_args())
