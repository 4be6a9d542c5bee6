"""`tandem bench steps TRACE`: where a served run's step time went, from a `--step-trace`
file: steps that carried a prompt chunk under the L1 throttle, other steps with prompt
tokens, and decode-only steps; their durations and share of the busy time; and what grammar
masking (structured outputs) cost."""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from tandem.bench.report import table

STEP_FIELDS = (
    "start",
    "seconds",
    "tokens",
    "prefill_tokens",
    "throttled_prefill_tokens",
    "waiting",
    "running",
)


def read_steps(path: Path) -> list[dict]:
    """The steps of a `--step-trace` file; a line that is not a step is an error naming it."""
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"cannot read the step trace {path}: {e}") from None
    steps = []
    for line, raw in enumerate(text.splitlines(), 1):
        if not raw.strip():
            continue
        try:
            rec = json.loads(raw)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{line}: not JSON ({e}); a truncated step trace?") from None
        missing = (
            [k for k in STEP_FIELDS if k not in rec] if isinstance(rec, dict) else list(STEP_FIELDS)
        )
        if missing:
            raise ValueError(
                f"{path}:{line}: not a step trace line (missing {', '.join(missing)}); "
                f"the file of `tandem serve --step-trace`?"
            )
        steps.append(rec)
    if not steps:
        raise ValueError(f"{path}: holds no steps (empty)")
    return steps


def summarize(steps: list[dict]) -> dict:
    kinds = {
        "throttled prefill": [s for s in steps if s["throttled_prefill_tokens"]],
        "other prefill": [
            s for s in steps if s["prefill_tokens"] and not s["throttled_prefill_tokens"]
        ],
        "decode only": [s for s in steps if not s["prefill_tokens"]],
    }
    busy = sum(s["seconds"] for s in steps) or 1.0
    out = {}
    for kind, group in kinds.items():
        ms = sorted(s["seconds"] * 1e3 for s in group)
        if not ms:
            continue
        out[kind] = {
            "steps": len(ms),
            "p50_ms": statistics.median(ms),
            "p90_ms": ms[int(0.9 * (len(ms) - 1))],
            "busy_share": sum(ms) / 1e3 / busy,
            "prefill_tokens_p50": statistics.median(s["prefill_tokens"] for s in group),
        }
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("trace", type=Path, help="a file written by `tandem serve --step-trace`")


def main(args: argparse.Namespace) -> None:
    steps = read_steps(args.trace)
    rows = [["steps", "count", "p50 ms", "p90 ms", "busy share", "prompt tokens p50"]]
    for kind, s in summarize(steps).items():
        rows.append(
            [
                kind,
                str(s["steps"]),
                f"{s['p50_ms']:.1f}",
                f"{s['p90_ms']:.1f}",
                f"{s['busy_share']:.0%}",
                f"{s['prefill_tokens_p50']:.0f}",
            ]
        )
    print(table(rows))
    masked = [s["structured_output_seconds"] for s in steps if s.get("structured_output_seconds")]
    if masked:
        busy = sum(s["seconds"] for s in steps) or 1.0
        print(
            f"grammar masks: {len(masked)} steps, {sum(masked) * 1e3:.1f} ms "
            f"({sum(masked) / busy:.1%} of busy time), "
            f"p50 {statistics.median(masked) * 1e3:.2f} ms per masked step"
        )
