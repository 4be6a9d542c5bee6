"""`tandem bench spec`: speculative decoding off and with each proposer asked for (`--method
ngram,draft`, the drafts of `--speculative-model self:int4,self:int8`), side by side in one
run, on the two prompt sets shipped in bench/data/spec_prompts.json: `grounded` (edit a given
text: the answer copies spans of the prompt) and `chat` (open questions). Batch 1 runs the
prompts one at a time (single-stream decode); batch B submits B chat prompts at once (cycled).
Greedy, chat template applied.

Each configuration keeps a process of its own for the whole run (its peak RSS is its own), and
the cases alternate between them: a case runs in every configuration before the next case
starts, the order rotating by one from one case to the next (A B C, B C A, C A B: reversing it
would keep B in the middle every time, and a bias of the position would land on B), for
`--rounds` rounds. Run one
configuration to its end and then the next, and a shared machine's drift between them can
move a ratio as much as speculation does; alternating takes each on/off pair within seconds.
The first round meets AdaptiveK's buckets new (a fresh server's probes); later rounds find
them measured. A row gives each round's ratio and their geometric
mean. Tokens equal to speculation off are counted, since a verify step's GEMM shapes differ
from a one-token step's and low precision can flip a near-tie; with `--deterministic` every
output must equal speculation off, in any precision.

`--policy-cost FILE` runs nothing: it reads a `--trace-adaptive` file and prints what
AdaptiveK's own choices cost."""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import time
from collections import defaultdict
from importlib import resources
from statistics import median

from tandem.bench.measure import peak_rss_mb, replace_args, spec_summary
from tandem.config.args import add_engine_arguments, given

# With --deterministic every output must equal speculation off's.
ENGINE_OPTIONS = ("model", "dtype", "num_threads", "deterministic")


def load_prompt_sets() -> dict[str, list[str]]:
    doc = json.loads(resources.files("tandem.bench").joinpath("data/spec_prompts.json").read_text())
    return {"grounded": doc["grounded"], "chat": doc["chat"]}


def _cases(args) -> list[tuple[str, int]]:
    return [(name, 1) for name in ("grounded", "chat")] + [
        ("chat", b) for b in args.batch_sizes if b > 1
    ]


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


class CaseRunner:
    """One configuration's engine, warmed up, running cases (a prompt set at a batch size) and
    measuring each: tokens/s, step and draft costs, the speculation counters' increase."""

    def __init__(self, args) -> None:
        from tandem import LLM, SamplingParams

        self.args, self.spec, self.sets = args, args.spec, load_prompt_sets()
        self.llm = LLM(
            **given(args, ENGINE_OPTIONS),
            max_num_seqs=max(args.batch_sizes),
            speculative_config=self.spec,
            enable_prefix_caching=False,
        )
        self.params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
        self.llm.chat(
            [{"role": "user", "content": "Hello"}], SamplingParams(max_tokens=4)
        )  # warm-up
        self.engine = self.llm.engine
        self.case: dict = {}  # the case running, for --trace-adaptive's lines
        self.trace = self._open_trace()

    def _open_trace(self):
        """--trace-adaptive: AdaptiveK's choices and the steps it saw, one JSON line each, labelled
        with the proposer and the case running; None when off."""
        if not self.args.trace_adaptive or not self.spec:
            return None
        f = open(self.args.trace_adaptive, "a", buffering=1)  # processes take turns appending
        label = self.spec.get("model") or self.spec["method"]
        if not self.engine.trace_adaptive_k(
            lambda event: f.write(json.dumps({"proposer": label, **self.case, **event}) + "\n")
        ):
            f.close()
            return None
        return f

    def run(self, name: str, batch: int, round_: int) -> dict:
        self.case.update(set=name, batch=batch, round=round_)
        sets, engine = self.sets, self.engine
        prompts = (
            sets[name][: self.args.num_prompts]
            if batch == 1
            else [sets[name][i % len(sets[name])] for i in range(batch)]
        )
        engine.reset_stats()
        before = engine.step_counters()
        started_at, start, outs = time.time(), time.perf_counter(), []
        for group in [[p] for p in prompts] if batch == 1 else [prompts]:
            outs += self.llm.chat([[{"role": "user", "content": p}] for p in group], self.params)
        seconds = time.perf_counter() - start
        tokens, st = [o.outputs[0].token_ids for o in outs], engine.step_counters()
        delta = type(st.spec)(
            st.spec.num_drafts - before.spec.num_drafts,
            st.spec.num_draft_tokens - before.spec.num_draft_tokens,
            st.spec.num_accepted_tokens - before.spec.num_accepted_tokens,
        )
        forwards = st.draft_forwards - before.draft_forwards
        return {
            "set": name,
            "batch": batch,
            "round": round_,
            "started_at": started_at,
            "output_tokens": sum(map(len, tokens)),
            "seconds": seconds,
            "output_throughput": sum(map(len, tokens)) / seconds,
            "steps": st.num_steps,
            "execute_s": st.phase_times["execute"],
            "gap_s": st.phase_times[
                "gap"
            ],  # the executor idle between steps (a drafting step's hand-back)
            # proposing drafts (within execute: a draft model's forwards, prompt lookup), and
            # a draft model's one-token forwards
            "propose_s": st.phase_times["propose"],
            "draft_forwards": forwards,
            "spec_decode": spec_summary(delta) if self.spec else None,
            "token_ids": tokens,
        }

    def close(self) -> dict:
        if self.trace is not None:
            self.trace.close()
        info = self.engine.info()
        return {
            "dtype": info.dtype,
            "peak_rss_mb": peak_rss_mb(),
            "async_scheduling": info.async_scheduling,
        }


def _serve_cases(args, conn) -> None:
    """A configuration's process: build its CaseRunner, say so, run the cases it is sent until
    None, then send its summary."""
    runner = CaseRunner(args)
    conn.send("ready")
    while (case := conn.recv()) is not None:
        conn.send(runner.run(*case))
    conn.send(runner.close())


class ConfigProcess:
    """A configuration's process, seen from the parent."""

    def __init__(self, name: str, args) -> None:
        self.name = name
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_serve_cases, args=(args, child), daemon=True)
        self.proc.start()

    def recv(self):
        try:
            return self.conn.recv()
        except EOFError:
            self.proc.join()
            raise SystemExit(
                f"bench spec: the {self.name} process ended (exit code {self.proc.exitcode}); "
                "its error is above"
            ) from None

    def run(self, case: tuple[str, int, int]) -> dict:
        self.conn.send(case)
        return self.recv()

    def close(self) -> dict:
        self.conn.send(None)
        summary = self.recv()
        self.proc.join()
        return summary


def run_interleaved(args, specs: dict[str, dict | None]) -> tuple[dict, dict]:
    """Every case in every configuration, alternating the order (see the module): per
    configuration, its summary and its case results by (case index, round)."""
    from tqdm import tqdm

    procs = {
        name: ConfigProcess(name, replace_args(args, spec=spec)) for name, spec in specs.items()
    }
    for p in procs.values():  # all built and warm before anything is timed
        p.recv()  # "ready"
    results: dict[str, dict] = {name: {} for name in procs}
    cases, names = _cases(args), list(procs)
    with tqdm(total=args.rounds * len(cases) * len(names), desc="bench spec", unit="run") as bar:
        for r in range(args.rounds):
            for i, (set_name, batch) in enumerate(cases):
                shift = (r * len(cases) + i) % len(names)
                for name in names[shift:] + names[:shift]:
                    results[name][i, r] = procs[name].run((set_name, batch, r))
                    bar.update()
    return {name: p.close() for name, p in procs.items()}, results


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


def policy_cost(path: str, batch_sizes: list[int]) -> list[dict]:
    """Per proposer, batch and round of a --trace-adaptive file: the seconds of the drafting
    steps beyond what plain steps (the round's median per request) would have taken for the
    tokens they emitted (each request credited E(k) at the round's last acceptance), plus the
    proposals made in plain steps, and that as a share of the round's step seconds."""
    cases = defaultdict(list)
    with open(path) as f:
        for line in f:
            e = json.loads(line)
            if e["batch"] in batch_sizes:
                cases[e["proposer"], e["batch"], e["round"]].append(e)
    rows = []
    for (proposer, batch, round_), events in sorted(cases.items()):
        steps = [e for e in events if e["event"] == "observe_step"]
        a = [e for e in events if e["event"] == "choose"][-1]["acceptance"]
        plain = [
            e["seconds"] / e["decodes"]
            for e in steps
            if e["decodes"] and not e["drafted"] and not e["proposal_seconds"]
        ]
        per_token, extra, drafting = median(plain), 0.0, 0
        for e in steps:
            if e["drafted"] and e["decodes"]:
                drafting += 1
                emitted = sum((1 - a ** (k + 1)) / (1 - a) if k else 1 for k in e["draft_counts"])
                extra += (
                    e["seconds"] - (emitted + e["decodes"] - len(e["draft_counts"])) * per_token
                )
            elif not e["drafted"]:
                extra += e["proposal_seconds"]
        total = sum(e["seconds"] for e in steps)
        rows.append(
            {
                "proposer": proposer,
                "batch": batch,
                "round": round_,
                "drafting_steps": drafting,
                "extra_s": extra,
                "step_s": total,
            }
        )
        print(
            f"{proposer:10} batch {batch:3} round {round_}: {drafting} drafting steps, "
            f"extra {extra * 1e3:6.0f} ms, "
            f"{100 * extra / total:4.1f}% of {total:.2f} s"
        )
    return rows


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
    ncases = len(_cases(args))
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
