"""`tandem bench spec`: speculative decoding on and off, side by side in one run, on the two
prompt sets shipped in bench/data/spec_prompts.json: `grounded` (edit a given text: the answer
copies spans of the prompt) and `chat` (open questions). Batch 1 runs the prompts one at a
time (single-stream decode); batch B submits B chat prompts at once (cycled). Greedy, chat
template applied. Each configuration runs in its own process (peak RSS is its own); tokens
equal across the two runs are counted, since a verify step's GEMM shapes differ from a
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


def run_config(args, _requests=None) -> dict:
    from tandem import LLM, SamplingParams
    spec = {"method": "ngram", "num_speculative_tokens": args.num_speculative_tokens} if args.spec else None
    llm = LLM(args.model, dtype=args.dtype, max_num_seqs=max(args.batch_sizes), speculative_config=spec,
              enable_prefix_caching=False)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    llm.chat([{"role": "user", "content": "Hello"}], SamplingParams(max_tokens=4))  # warm-up
    sets, engine, results = load_prompt_sets(), llm.engine, []
    for name, batch in _cases(args):
        prompts = sets[name][:args.num_prompts] if batch == 1 else \
            [sets[name][i % len(sets[name])] for i in range(batch)]
        engine.core.stats.reset()
        stats = engine.core.scheduler.spec_stats
        before = (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens)
        start, outs = time.perf_counter(), []
        for group in ([[p] for p in prompts] if batch == 1 else [prompts]):
            outs += llm.chat([[{"role": "user", "content": p}] for p in group], params)
        seconds = time.perf_counter() - start
        tokens, st = [o.outputs[0].token_ids for o in outs], engine.core.stats
        delta = type(stats)(stats.num_drafts - before[0], stats.num_draft_tokens - before[1],
                            stats.num_accepted_tokens - before[2])
        results.append({"set": name, "batch": batch, "output_tokens": sum(map(len, tokens)), "seconds": seconds,
                        "output_throughput": sum(map(len, tokens)) / seconds, "steps": st.num_steps,
                        "ms_per_step": st.phase_times["execute"] / max(st.num_steps, 1) * 1e3,
                        # the executor idle between steps (async overlap lost, e.g. a drafting step's hand-back)
                        "gap_ms_per_step": st.phase_times["gap"] / max(st.num_steps, 1) * 1e3,
                        "spec_decode": spec_summary(delta) if spec else None, "token_ids": tokens})
    return {"dtype": str(engine.core.executor.dtype).removeprefix("torch."), "peak_rss_mb": _peak_rss_mb(),
            "async_scheduling": engine.core.pipeline.overlap, "cases": results}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--num-speculative-tokens", type=int, default=4)
    p.add_argument("--batch-sizes", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8, 32, 64],
                   help="comma-separated; 1 runs both prompt sets one prompt at a time, the rest the chat set")
    p.add_argument("--num-prompts", type=int, default=8, help="prompts per set at batch 1")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--json", dest="json_path", default=None)


def main(args: argparse.Namespace) -> dict:
    off = in_subprocess(run_config, _replace(args, spec=False), None)
    on = in_subprocess(run_config, _replace(args, spec=True), None)
    print(f"{args.model} {on['dtype']}, greedy, {args.max_tokens} tokens max, k={args.num_speculative_tokens}; "
          f"peak RSS off {off['peak_rss_mb']:.0f} MiB, on {on['peak_rss_mb']:.0f} MiB "
          f"(async overlap: off {'on' if off['async_scheduling'] else 'off'}, on {'on' if on['async_scheduling'] else 'off'})")
    print(f"{'set':9} {'batch':>5} {'off tok/s':>10} {'on tok/s':>9} {'on/off':>7} {'accept':>7} {'mean len':>8} "
          f"{'off ms/step':>11} {'on ms/step':>10} {'gap off/on':>10} {'verifies':>8} {'equal':>7}")
    rows = []
    for a, b in zip(off["cases"], on["cases"]):
        sd = b["spec_decode"]
        equal = sum(x == y for x, y in zip(a.pop("token_ids"), b.pop("token_ids")))
        row = {"set": a["set"], "batch": a["batch"], "off": a, "on": b, "ratio": b["output_throughput"] / a["output_throughput"],
               "equal_outputs": equal, "num_outputs": args.num_prompts if a["batch"] == 1 else a["batch"]}
        rows.append(row)
        print(f"{a['set']:9} {a['batch']:>5} {a['output_throughput']:>10.1f} {b['output_throughput']:>9.1f} "
              f"{row['ratio']:>6.2f}x {sd['acceptance_rate']:>7.1%} {sd['mean_accepted_length']:>8.2f} "
              f"{a['ms_per_step']:>11.1f} {b['ms_per_step']:>10.1f} {a['gap_ms_per_step']:>4.1f}/{b['gap_ms_per_step']:<5.1f} "
              f"{sd['num_drafts']:>8} {equal:>3}/{row['num_outputs']}")
    report = {"config": {k: v for k, v in vars(args).items() if k not in ("func", "json_path")},
              "off": {k: v for k, v in off.items() if k != "cases"}, "on": {k: v for k, v in on.items() if k != "cases"},
              "rows": rows}
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump(report, f, indent=2)
    return report
