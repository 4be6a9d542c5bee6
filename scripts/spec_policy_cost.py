"""What AdaptiveK's own choices cost, per proposer, batch and round of a `tandem bench spec
--trace-adaptive FILE` run (docs/benchmarks.md section 25): the seconds of its drafting steps
beyond what plain steps (that round's median per request) would have taken for the tokens they
emitted (each request credited E(k) at the acceptance of the round's last choice), plus the
proposals made in plain steps, as a share of the round's step seconds.
Run: .venv/bin/python scripts/spec_policy_cost.py FILE [--batch-sizes 32,64]"""
import argparse
import json
from collections import defaultdict
from statistics import median

p = argparse.ArgumentParser()
p.add_argument("trace")
p.add_argument("--batch-sizes", default="32,64")
args = p.parse_args()
batches = {int(b) for b in args.batch_sizes.split(",")}
cases = defaultdict(list)
for line in open(args.trace):
    e = json.loads(line)
    if e["batch"] in batches:
        cases[e["proposer"], e["batch"], e["round"]].append(e)
for (proposer, batch, rnd), events in sorted(cases.items()):
    steps = [e for e in events if e["event"] == "observe_step"]
    a = [e for e in events if e["event"] == "choose"][-1]["acceptance"]
    plain = [e["seconds"] / e["decodes"] for e in steps if e["decodes"] and not e["drafted"] and not e["proposal_seconds"]]
    per_token, extra, drafting = median(plain), 0.0, 0
    for e in steps:
        if e["drafted"] and e["decodes"]:
            drafting += 1
            emitted = sum((1 - a ** (k + 1)) / (1 - a) if k else 1 for k in e["draft_counts"])
            emitted += e["decodes"] - len(e["draft_counts"])
            extra += e["seconds"] - emitted * per_token
        elif not e["drafted"]:
            extra += e["proposal_seconds"]
    total = sum(e["seconds"] for e in steps)
    print(f"{proposer:10} batch {batch:3} round {rnd}: {drafting} drafting steps, extra {extra * 1e3:6.0f} ms, "
          f"{100 * extra / total:4.1f}% of {total:.2f} s")
