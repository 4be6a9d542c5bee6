"""`tandem bench spec`: speculative decoding off and with each proposer asked for (`--method
ngram,draft`, the drafts of `--speculative-model self:int4,self:int8`), side by side in one
run, on the two prompt sets shipped in bench/data/spec_prompts.json: `grounded` (edit a given
text: the answer copies spans of the prompt) and `chat` (open questions). Batch 1 runs the
prompts one at a time (single-stream decode); batch B submits B chat prompts at once (cycled).
Greedy, chat template applied.

The configurations take turns case by case, for `--rounds` rounds (bench/spec_runner.py). A
row gives each round's ratio and their geometric mean. Tokens equal to speculation off are
counted, since a verify step's GEMM shapes differ from a one-token step's and low precision can
flip a near-tie; with `--deterministic` every output must equal speculation off, in any
precision.

`--policy-cost FILE` runs nothing: it reads a `--trace-adaptive` file and prints what
AdaptiveK's own choices cost (bench/spec_policy_cost.py)."""

from __future__ import annotations

import argparse
import json
import math

from tandem.bench.measure import spec_summary
from tandem.bench.spec_policy_cost import policy_cost
from tandem.bench.spec_runner import ENGINE_OPTIONS, case_list, run_interleaved
from tandem.config.args import add_engine_arguments


def proposers(args) -> dict[str, dict]:
    """The speculative configurations to compare with speculation off, by name."""
    out = {}
    for method in args.method.split(","):
        if method == "ngram":
            out["ngram"] = {"method": "ngram"}
        elif method == "draft":
            out.update(
                (m, {"method": "draft", "model": m}) for m in args.speculative_model.split(",")
            )
        else:
            raise SystemExit(
                f"--method: unknown speculative method {method!r}; known: ngram, draft"
            )
    for spec in out.values():
        spec.update(num_speculative_tokens=args.num_speculative_tokens, adaptive=args.adaptive)
    return out


def _sum(runs: list[dict], key: str) -> float:
    return sum(run[key] for run in runs)


def _row(name: str, off: list[dict], on: list[dict]) -> dict:
    """One proposer on one case over the rounds: the ratio of each round and their geometric
    mean, the rates and step costs over all rounds, the drafts' counters summed."""
    from tandem.core.spec_decode import SpecDecodeStats

    ratios = [b["output_throughput"] / a["output_throughput"] for a, b in zip(off, on)]
    sd = SpecDecodeStats(
        *(
            int(sum(b["spec_decode"][k] for b in on))
            for k in ("num_drafts", "num_draft_tokens", "num_accepted_tokens")
        )
    )
    ref = [a["token_ids"] for a in off]
    equal = [sum(x == y for x, y in zip(r, b["token_ids"])) for r, b in zip(ref, on)]

    def rates(runs: list[dict]) -> dict:
        steps = max(_sum(runs, "steps"), 1)
        forwards = _sum(runs, "draft_forwards")
        return {
            "output_throughput": _sum(runs, "output_tokens") / _sum(runs, "seconds"),
            "output_throughput_per_round": [run["output_throughput"] for run in runs],
            "ms_per_step": _sum(runs, "execute_s") / steps * 1e3,
            "gap_ms_per_step": _sum(runs, "gap_s") / steps * 1e3,
            "propose_ms_per_step": _sum(runs, "propose_s") / steps * 1e3,
            "draft_ms_per_forward": _sum(runs, "propose_s") / forwards * 1e3 if forwards else None,
        }

    return {
        "proposer": name,
        "set": off[0]["set"],
        "batch": off[0]["batch"],
        "off": rates(off),
        "on": rates(on),
        "ratios": ratios,
        "ratio": math.exp(sum(map(math.log, ratios)) / len(ratios)),
        "spec_decode": spec_summary(sd),
        "equal_outputs": min(equal),
        "num_outputs": len(ref[0]),
    }


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_engine_arguments(p, ENGINE_OPTIONS, store_defaults=True)
    # The speculative configurations compared, each with speculation off: a grid, so these are
    # this command's own (lists), not the engine's --speculative-config.
    p.add_argument(
        "--method",
        default="ngram",
        help="comma-separated proposers to compare with speculation off: "
        "ngram, draft (one run per --speculative-model)",
    )
    p.add_argument(
        "--speculative-model",
        default="self:int4",
        help="comma-separated drafts of --method draft "
        "(self:int4, self:int8, self:bf16, or a model alias or path)",
    )
    p.add_argument(
        "--num-speculative-tokens",
        type=int,
        default=4,
        help="k, draft tokens per step at most (default 4; AdaptiveK chooses up to it)",
    )
    p.add_argument(
        "--adaptive",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="AdaptiveK chooses each step's k (--no-adaptive: always k)",
    )
    p.add_argument(
        "--batch-sizes",
        type=lambda s: [int(x) for x in s.split(",")],
        default=[1, 8, 32, 64],
        help="comma-separated; 1 runs both prompt sets one prompt at a time, the rest the chat set",
    )
    p.add_argument("--num-prompts", type=int, default=8, help="prompts per set at batch 1")
    p.add_argument(
        "--max-tokens", type=int, default=128, help="output tokens per request (default 128)"
    )
    p.add_argument(
        "--rounds",
        type=int,
        default=2,
        help="times every case runs in every configuration, alternating "
        "(the first with AdaptiveK new)",
    )
    p.add_argument(
        "--json",
        dest="json_path",
        default=None,
        help="also write every figure as JSON to this path",
    )
    p.add_argument(
        "--trace-adaptive",
        default=None,
        metavar="FILE",
        help="append AdaptiveK's choices and the steps it saw to FILE (JSON lines; the file is "
        "emptied first)",
    )
    p.add_argument(
        "--policy-cost",
        default=None,
        metavar="FILE",
        help="run nothing: from a --trace-adaptive FILE, print what AdaptiveK's drafting steps and "
        "proposals cost per proposer, batch (of --batch-sizes) and round",
    )


def main(args: argparse.Namespace) -> dict:
    if args.policy_cost:
        return {"policy_cost": policy_cost(args.policy_cost, args.batch_sizes)}
    if args.rounds < 1:
        raise SystemExit(f"--rounds must be at least 1, not {args.rounds}")
    specs = proposers(args)
    if args.trace_adaptive:
        open(args.trace_adaptive, "w").close()  # each configuration's process appends its lines
    summaries, results = run_interleaved(args, {"off": None, **specs})
    ncases = len(case_list(args))
    rows = [
        _row(
            name,
            [results["off"][i, r] for r in range(args.rounds)],
            [results[name][i, r] for r in range(args.rounds)],
        )
        for name in specs
        for i in range(ncases)
    ]
    off = summaries["off"]
    mode = ", deterministic" if args.deterministic else ""
    print(
        f"{args.model} {off['dtype']}{mode}, greedy, {args.max_tokens} tokens max, "
        f"k={args.num_speculative_tokens}"
        f"{'' if args.adaptive else ' (fixed)'}, {args.rounds} alternating round(s); peak RSS off "
        f"{off['peak_rss_mb']:.0f} MiB, "
        + ", ".join(f"{n} {summaries[n]['peak_rss_mb']:.0f} MiB" for n in specs)
        + f" (async overlap {'on' if off['async_scheduling'] else 'off'})"
    )
    print(
        f"{'proposer':10} {'set':9} {'batch':>5} {'off tok/s':>10} {'on tok/s':>9} {'on/off':>7} "
        f"{'per round':>16} {'accept':>7} {'mean len':>8} {'off ms/step':>11} {'on ms/step':>10} "
        f"{'gap off/on':>10} {'verifies':>8} "
        f"{'prop. ms':>8} {'ms/fwd':>6} {'equal':>7}"
    )
    for row in rows:
        a, b, sd = row["off"], row["on"], row["spec_decode"]
        fwd = f"{b['draft_ms_per_forward']:.1f}" if b["draft_ms_per_forward"] is not None else "-"
        per_round = "/".join(f"{x:.2f}" for x in row["ratios"])
        print(
            f"{row['proposer']:10} {row['set']:9} {row['batch']:>5} "
            f"{a['output_throughput']:>10.1f} {b['output_throughput']:>9.1f} "
            f"{row['ratio']:>6.2f}x {per_round:>16} {sd['acceptance_rate']:>7.1%} "
            f"{sd['mean_accepted_length']:>8.2f} {a['ms_per_step']:>11.1f} "
            f"{b['ms_per_step']:>10.1f} "
            f"{a['gap_ms_per_step']:>4.1f}/{b['gap_ms_per_step']:<5.1f} {sd['num_drafts']:>8} "
            f"{b['propose_ms_per_step']:>8.1f} {fwd:>6} "
            f"{row['equal_outputs']:>3}/{row['num_outputs']}"
        )
    runs = {
        name: [
            {k: v for k, v in run.items() if k != "token_ids"}
            for _, run in sorted(per_case.items())
        ]
        for name, per_case in results.items()
    }  # every case run, by case then round
    report = {
        "config": {k: v for k, v in vars(args).items() if k not in ("func", "json_path")},
        "summaries": summaries,
        "rows": rows,
        "runs": runs,
    }
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump(report, f, indent=2)
    return report
