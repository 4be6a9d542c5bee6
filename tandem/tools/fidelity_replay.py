"""The real runs of `tandem bench fidelity`: each against a fresh `tandem serve` with a step trace,
loaded by `tandem bench serve` (the client a user would run, streaming). A replay sends the trace
window; a calibration load sends random prompts at a few concurrencies, so that what serving
adds to a decode step is measured on a workload other than the one being judged."""

from __future__ import annotations

import argparse
import json
import urllib.request
from pathlib import Path

from tandem.bench import serve
from tandem.bench.measure import replace_args
from tandem.bench.soak_target import start_target
from tandem.config.args import given

SERVER_OPTIONS = ("quantization", "num_threads", "max_num_seqs")  # start_target passes the rest
# The calibration load: concurrency, and prompt / output tokens of each random request.
CALIBRATION_CONCURRENCY = (1, 4, 16)
CALIBRATION_LENGTHS = (64, 128)


def flags(values: dict) -> list[str]:
    return [
        x for k, v in values.items() if v is not None for x in (f"--{k.replace('_', '-')}", str(v))
    ]


def _warm_up(url: str, model: str) -> None:
    """One short completion first: a fresh server's first step builds kernels, which the
    profile (measured warm) does not count."""
    body = json.dumps({"model": model, "prompt": "Hello", "max_tokens": 4}).encode()
    req = urllib.request.Request(
        f"{url}/v1/completions", body, {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=600) as r:
        r.read()


def served_runs(args: argparse.Namespace, trace: Path, loads: list[dict]) -> list[dict]:
    """Start a server that writes its step trace to `trace`, run `tandem bench serve` once per
    entry of `loads` (options over the fidelity run's own), return their results."""
    server = replace_args(
        args,
        url=None,
        cluster=None,
        serve_args=flags(given(args, SERVER_OPTIONS))
        + ["--step-trace", str(trace)]
        + args.serve_args,
    )
    trace.unlink(missing_ok=True)  # the trace appends
    target = start_target(server)
    try:
        _warm_up(target.url, args.model)
        parser = argparse.ArgumentParser()
        serve.add_arguments(parser)
        defaults = parser.parse_args([])
        # the fidelity run's own --result-dir holds what a load saves only when it asks to
        shared = {k: v for k, v in vars(args).items() if k in vars(defaults) and k != "result_dir"}
        runs = []
        for load in loads:
            bench = replace_args(
                defaults, **{**shared, "base_url": target.url, "quiet": True, **load}
            )
            runs.append(serve.main(bench))
        return runs
    finally:
        target.stop()


def replay(args: argparse.Namespace, out: Path, i: int) -> dict:
    """Replay i of the trace window against a fresh server; its result is saved as real-i."""
    load = {"save_result": True, "result_dir": str(out), "result_filename": f"real-{i}.json"}
    return served_runs(args, out / f"steps-{i}.jsonl", [load])[0]


def calibrate(args: argparse.Namespace, out: Path) -> Path:
    """Random requests at each CALIBRATION_CONCURRENCY against a fresh server, four times as
    many as the concurrency; returns its step trace."""
    prompt, output = CALIBRATION_LENGTHS
    loads = [
        {
            "trace": None,
            "dataset_name": "random",
            "input_len": prompt,
            "output_len": output,
            "range_ratio": 0.0,
            "num_prompts": 4 * c,
            "max_concurrency": c,
            "request_rate": float("inf"),
            "seed": c,
        }
        for c in CALIBRATION_CONCURRENCY
    ]
    trace = out / "steps-calibration.jsonl"
    served_runs(args, trace, loads)
    return trace
