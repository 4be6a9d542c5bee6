"""`tandem bench spec --policy-cost FILE`: what AdaptiveK's own choices cost, read from a
`--trace-adaptive` file (bench/spec_runner.py writes it); nothing runs."""

from __future__ import annotations

import json
from collections import defaultdict
from statistics import median


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
