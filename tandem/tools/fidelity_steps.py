"""Per-step ground truth for `tandem bench fidelity`: each real step of a replay (from the
server's `--step-trace`: its batch shape and how long the executor took) against the cost
model's prediction for the same shape, by kind of step; and the executor's idle time between
two steps while requests were left (the engine's own work the cost model must also charge)."""

from __future__ import annotations

import statistics
from pathlib import Path

from tandem.bench.steps import read_steps
from tandem.sim.cost_model import BatchShape, CostModel

KINDS = ("decode", "prefill", "mixed")


def shape(step: dict) -> BatchShape:
    return BatchShape(
        step["prefill_tokens"], step["prefill_attention"], step["decodes"], step["decode_context"]
    )


def kind(s: BatchShape) -> str:
    if not s.num_prefill_tokens:
        return "decode"
    return "mixed" if s.num_decode_seqs else "prefill"


def busy_gaps(steps: list[dict]) -> list[float]:
    """Seconds from each step's end to the next one's start, where requests were left after
    it (an idle engine waits for arrivals: not a cost)."""
    return [
        max(b["start"] - a["start"] - a["seconds"], 0.0)
        for a, b in zip(steps, steps[1:])
        if a["running"] or a["waiting"]
    ]


def compare_steps(paths: list[Path], cost: CostModel) -> dict:
    """Per kind: steps, measured and predicted mean ms, the median relative error of the
    prediction per step and the median of its size; and the mean gap between busy steps."""
    traces = [read_steps(p) for p in paths]
    steps = [s for t in traces for s in t]
    rows = {}
    for k in KINDS:
        pairs = [(s["seconds"], cost.step_time(shape(s))) for s in steps if kind(shape(s)) == k]
        if not pairs:
            continue
        errors = [(p - m) / m for m, p in pairs if m > 0]
        rows[k] = {
            "steps": len(pairs),
            "real_ms": 1e3 * statistics.fmean(m for m, _ in pairs),
            "predicted_ms": 1e3 * statistics.fmean(p for _, p in pairs),
            "median_error": statistics.median(errors),
            "median_abs_error": statistics.median(abs(e) for e in errors),
        }
    gaps = [g for t in traces for g in busy_gaps(t)]
    return {
        "kinds": rows,
        "gap_ms": 1e3 * statistics.fmean(gaps) if gaps else None,
    }


def decode_excess(paths: list[Path], cost: CostModel) -> tuple[float, float]:
    """(seconds a step, seconds a request) that served decode steps take beyond the profile's
    prediction: the median excess at each batch size, fit as a line weighted by the steps at
    it (a median per size: a step the OS delayed does not move it). Both kept >= 0."""
    excess: dict[int, list[float]] = {}
    for s in (s for p in paths for s in read_steps(p)):
        b = shape(s)
        if kind(b) == "decode" and b.num_decode_seqs:
            excess.setdefault(b.num_decode_seqs, []).append(s["seconds"] - cost.step_time(b))
    if not excess:
        raise ValueError("no decode steps to calibrate from")
    points = [(n, statistics.median(e), len(e)) for n, e in excess.items()]
    weight = sum(w for *_, w in points)
    mx = sum(n * w for n, _, w in points) / weight
    my = sum(y * w for _, y, w in points) / weight
    var = sum(w * (n - mx) ** 2 for n, _, w in points)
    slope = max(sum(w * (n - mx) * (y - my) for n, y, w in points) / var, 0.0) if var else 0.0
    return max(my - slope * mx, 0.0), slope


def format_steps(report: dict) -> str:
    lines = [
        f"{'steps':8} {'count':>7} {'real ms':>8} {'model ms':>9} {'median err':>11} "
        f"{'median |err|':>13}"
    ]
    for k, r in report["kinds"].items():
        lines.append(
            f"{k:8} {r['steps']:7} {r['real_ms']:8.2f} {r['predicted_ms']:9.2f} "
            f"{r['median_error']:+11.1%} {r['median_abs_error']:13.1%}"
        )
    if report["gap_ms"] is not None:
        lines.append(f"executor idle between busy steps: {report['gap_ms']:.2f} ms (mean)")
    return "\n".join(lines)
