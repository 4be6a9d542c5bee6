"""The runs of `tandem bench spec`. Each configuration (speculation off, or a proposer) keeps a
process of its own for the whole run (its peak RSS is its own), and the cases (a prompt set at a
batch size) alternate between them: a case runs in every configuration before the next case
starts, the order rotating by one from one case to the next (A B C, B C A, C A B: reversing it
would keep B in the middle every time, and a bias of the position would land on B), for
`--rounds` rounds. Run one configuration to its end and then the next, and a shared machine's
drift between them can move a ratio as much as speculation does; alternating takes each on/off
pair within seconds. The first round meets AdaptiveK's buckets new (a fresh server's probes);
later rounds find them measured."""

from __future__ import annotations

import json
import multiprocessing as mp
import time
from importlib import resources

from tandem.bench.measure import peak_rss_mb, replace_args, spec_summary
from tandem.config.args import given

# With --deterministic every output must equal speculation off's.
ENGINE_OPTIONS = ("model", "dtype", "num_threads", "deterministic")


def load_prompt_sets() -> dict[str, list[str]]:
    doc = json.loads(resources.files("tandem.bench").joinpath("data/spec_prompts.json").read_text())
    return {"grounded": doc["grounded"], "chat": doc["chat"]}


def case_list(args) -> list[tuple[str, int]]:
    """The cases, each a prompt set at a batch size: both sets at batch 1, the chat
    set at each larger --batch-sizes."""
    return [(name, 1) for name in ("grounded", "chat")] + [
        ("chat", b) for b in args.batch_sizes if b > 1
    ]


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
        # warm-up
        self.llm.chat([{"role": "user", "content": "Hello"}], SamplingParams(max_tokens=4))
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
            # the executor idle between steps (a drafting step's hand-back)
            "gap_s": st.phase_times["gap"],
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
    cases, names = case_list(args), list(procs)
    with tqdm(total=args.rounds * len(cases) * len(names), desc="bench spec", unit="run") as bar:
        for r in range(args.rounds):
            for i, (set_name, batch) in enumerate(cases):
                shift = (r * len(cases) + i) % len(names)
                for name in names[shift:] + names[:shift]:
                    results[name][i, r] = procs[name].run((set_name, batch, r))
                    bar.update()
    return {name: p.close() for name, p in procs.items()}, results
