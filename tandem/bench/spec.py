"""`tandem bench spec`: speculative decoding off and with each proposer asked for (`--method
ngram,draft`, the drafts of `--speculative-model self:int4,self:int8`), side by side in one
run, on the two prompt sets shipped in bench/data/spec_prompts.json: `grounded` (edit a given text: the answer
copies spans of the prompt) and `chat` (open questions). Batch 1 runs the prompts one at a
time (single-stream decode); batch B submits B chat prompts at once (cycled). Greedy, chat
template applied. Each configuration runs in its own process (peak RSS is its own); tokens
equal to speculation off are counted, since a verify step's GEMM shapes differ from a
one-token step's and low precision can flip a near-tie."""
from __future__ import annotations

import argparse
import json
import time
from importlib import resources

from tandem.bench.offline import in_subprocess, _peak_rss_mb, _replace, spec_summary


def load_prompt_sets() -> dict[str, list[str]]:
    doc = json.loads(resources.files("tandem.bench").joinpath("data/spec_prompts.json").read_text())
    return {"grounded": doc["grounded"], "chat": doc["chat"]}


def _cases(args) -> list[tuple[str, int]]:
    return [(name, 1) for name in ("grounded", "chat")] + [("chat", b) for b in args.batch_sizes if b > 1]


def proposers(args) -> dict[str, dict]:
    """The speculative configurations to compare with speculation off, by name."""
    out = {}
    for method in args.method.split(","):
        if method == "ngram":
            out["ngram"] = {"method": "ngram"}
        elif method == "draft":
            out.update((m, {"method": "draft", "model": m}) for m in args.speculative_model.split(","))
        else:
            raise SystemExit(f"--method: unknown speculative method {method!r}; known: ngram, draft")
    for spec in out.values():
        spec.update(num_speculative_tokens=args.num_speculative_tokens, adaptive=args.adaptive)
    return out


def _open_trace(args, policy, case: dict):
    """--trace-adaptive: AdaptiveK's choices and the steps it saw, one JSON line each, labelled
    with the proposer and the case running (`case`, updated by the caller); None when off."""
    if not args.trace_adaptive or policy is None:
        return None
    f = open(args.trace_adaptive, "a")
    label = args.spec.get("model") or args.spec["method"]
    policy.trace = lambda event: f.write(json.dumps({"proposer": label, **case, **event}) + "\n")
    return f


def run_config(args, _requests=None) -> dict:
    from tandem import LLM, SamplingParams
    spec = args.spec
    llm = LLM(args.model, dtype=args.dtype, max_num_seqs=max(args.batch_sizes), speculative_config=spec,
              enable_prefix_caching=False, num_threads=args.num_threads)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    llm.chat([{"role": "user", "content": "Hello"}], SamplingParams(max_tokens=4))  # warm-up
    sets, engine, results = load_prompt_sets(), llm.engine, []
    case: dict = {}
    trace = _open_trace(args, engine.core.scheduler.spec_policy, case)
    for name, batch in _cases(args):
        case.update(set=name, batch=batch)
        prompts = sets[name][:args.num_prompts] if batch == 1 else \
            [sets[name][i % len(sets[name])] for i in range(batch)]
        engine.core.stats.reset()
        stats = engine.core.scheduler.spec_stats
        before = (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens)
        drafter = getattr(engine.core.executor, "drafter", None)
        draft_before = (drafter.num_forwards, drafter.seconds) if drafter is not None else (0, 0.0)
        start, outs = time.perf_counter(), []
        for group in ([[p] for p in prompts] if batch == 1 else [prompts]):
            outs += llm.chat([[{"role": "user", "content": p}] for p in group], params)
        seconds = time.perf_counter() - start
        tokens, st = [o.outputs[0].token_ids for o in outs], engine.core.stats
        delta = type(stats)(stats.num_drafts - before[0], stats.num_draft_tokens - before[1],
                            stats.num_accepted_tokens - before[2])
        steps = max(engine.core.stats.num_steps, 1)
        forwards, draft_s = (drafter.num_forwards - draft_before[0], drafter.seconds - draft_before[1]) \
            if drafter is not None else (0, 0.0)
        results.append({"set": name, "batch": batch, "output_tokens": sum(map(len, tokens)), "seconds": seconds,
                        "output_throughput": sum(map(len, tokens)) / seconds, "steps": st.num_steps,
                        "ms_per_step": st.phase_times["execute"] / steps * 1e3,
                        # the executor idle between steps (async overlap lost, e.g. a drafting step's hand-back)
                        "gap_ms_per_step": st.phase_times["gap"] / steps * 1e3,
                        # a draft model's part of each step, and of each of its one-token forwards
                        "draft_ms_per_step": draft_s / steps * 1e3,
                        "draft_ms_per_forward": draft_s / forwards * 1e3 if forwards else None,
                        "spec_decode": spec_summary(delta) if spec else None, "token_ids": tokens})
    if trace is not None:
        trace.close()
    return {"dtype": str(engine.core.executor.dtype).removeprefix("torch."), "peak_rss_mb": _peak_rss_mb(),
            "async_scheduling": engine.core.pipeline.overlap, "cases": results}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--method", default="ngram", help="comma-separated proposers to compare with speculation off: "
                   "ngram, draft (one run per --speculative-model)")
    p.add_argument("--speculative-model", default="self:int4",
                   help="comma-separated drafts of --method draft (self:int4, self:int8, self:bf16, or a model alias or path)")
    p.add_argument("--num-speculative-tokens", type=int, default=4)
    p.add_argument("--adaptive", action=argparse.BooleanOptionalAction, default=True,
                   help="AdaptiveK chooses each step's k (--no-adaptive: always k)")
    p.add_argument("--batch-sizes", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8, 32, 64],
                   help="comma-separated; 1 runs both prompt sets one prompt at a time, the rest the chat set")
    p.add_argument("--num-prompts", type=int, default=8, help="prompts per set at batch 1")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--num-threads", type=int, default=None, help="CPU threads (default: all cores)")
    p.add_argument("--json", dest="json_path", default=None)
    p.add_argument("--trace-adaptive", default=None, metavar="FILE",
                   help="append AdaptiveK's choices and the steps it saw to FILE (JSON lines; the file is "
                        "emptied first)")


def main(args: argparse.Namespace) -> dict:
    specs = proposers(args)
    if args.trace_adaptive:
        open(args.trace_adaptive, "w").close()  # each configuration's process appends its lines
    off = in_subprocess(run_config, _replace(args, spec=None), None)
    runs = {name: in_subprocess(run_config, _replace(args, spec=spec), None) for name, spec in specs.items()}
    print(f"{args.model} {off['dtype']}, greedy, {args.max_tokens} tokens max, k={args.num_speculative_tokens}"
          f"{'' if args.adaptive else ' (fixed)'}; peak RSS off {off['peak_rss_mb']:.0f} MiB, "
          + ", ".join(f"{n} {r['peak_rss_mb']:.0f} MiB" for n, r in runs.items())
          + f" (async overlap {'on' if off['async_scheduling'] else 'off'})")
    print(f"{'proposer':10} {'set':9} {'batch':>5} {'off tok/s':>10} {'on tok/s':>9} {'on/off':>7} {'accept':>7} "
          f"{'mean len':>8} {'off ms/step':>11} {'on ms/step':>10} {'gap off/on':>10} {'verifies':>8} "
          f"{'draft ms':>8} {'ms/fwd':>6} {'equal':>7}")
    rows = []
    off_tokens = [a.pop("token_ids") for a in off["cases"]]
    for name, run in runs.items():
        for a, b, ref in zip(off["cases"], run["cases"], off_tokens):
            sd = b["spec_decode"]
            equal = sum(x == y for x, y in zip(ref, b.pop("token_ids")))
            row = {"proposer": name, "set": a["set"], "batch": a["batch"], "off": a, "on": b,
                   "ratio": b["output_throughput"] / a["output_throughput"],
                   "equal_outputs": equal, "num_outputs": len(ref)}
            rows.append(row)
            fwd = f"{b['draft_ms_per_forward']:.1f}" if b["draft_ms_per_forward"] is not None else "-"
            print(f"{name:10} {a['set']:9} {a['batch']:>5} {a['output_throughput']:>10.1f} {b['output_throughput']:>9.1f} "
                  f"{row['ratio']:>6.2f}x {sd['acceptance_rate']:>7.1%} {sd['mean_accepted_length']:>8.2f} "
                  f"{a['ms_per_step']:>11.1f} {b['ms_per_step']:>10.1f} {a['gap_ms_per_step']:>4.1f}/{b['gap_ms_per_step']:<5.1f} "
                  f"{sd['num_drafts']:>8} {b['draft_ms_per_step']:>8.1f} {fwd:>6} "
                  f"{equal:>3}/{row['num_outputs']}")
    report = {"config": {k: v for k, v in vars(args).items() if k not in ("func", "json_path")},
              "off": {k: v for k, v in off.items() if k != "cases"},
              "runs": {n: {k: v for k, v in r.items() if k != "cases"} for n, r in runs.items()}, "rows": rows}
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump(report, f, indent=2)
    return report
