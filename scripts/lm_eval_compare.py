"""lm-eval-harness's per-sample loglikelihoods (its --log_samples file) against Tandem's own
teacher-forced logprobs in fp32: each (context, continuation) pair tokenised as lm-eval's
_encode_pair does, scored by the engine's prompt logprobs, and summed over the continuation.
Exits non-zero, naming the pair, on any difference over TOL or on a sample that has none.

    python scripts/lm_eval_compare.py SAMPLES.jsonl MODEL
"""

from __future__ import annotations

import json
import sys

from tandem import LLM, SamplingParams

TOL = 1e-4


def encode_pair(tokenizer, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """lm-eval's causal-model split: trailing spaces move to the continuation, the whole is
    encoded once, and the continuation is what follows the context's own encoding."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole = tokenizer.encode(context + continuation, add_special_tokens=False)
    ctx = tokenizer.encode(context, add_special_tokens=False)
    return ctx, whole[len(ctx) :]


def lm_eval_pairs(path: str) -> list[tuple[str, str, float]]:
    pairs = []
    for line in open(path):
        sample = json.loads(line)
        for args, resp in zip(sample["arguments"].values(), sample["resps"]):
            pairs.append((args["arg_0"], args["arg_1"], float(resp[0][0])))
    return pairs


def main(samples: str, model: str) -> int:
    pairs = lm_eval_pairs(samples)
    if not pairs:
        print(f"no loglikelihood samples in {samples}", file=sys.stderr)
        return 1
    llm = LLM(model, dtype="float32")
    encoded = [encode_pair(llm.tokenizer, ctx, cont) for ctx, cont, _ in pairs]
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    outs = llm.generate([ctx + cont for ctx, cont in encoded], params)
    worst, bad = 0.0, 0
    for (ctx, cont, theirs), (ctx_ids, _), out in zip(pairs, encoded, outs):
        # prompt_logprobs[p] scores token p + 1 given the tokens before it
        ours = sum(entry[0][1] for entry in out.prompt_logprobs[len(ctx_ids) - 1 :])
        worst = max(worst, abs(ours - theirs))
        if abs(ours - theirs) > TOL:
            bad += 1
            print(f"DIFFERS {ctx!r} + {cont!r}: lm-eval {theirs:.6f}, Tandem {ours:.6f}")
    print(f"lm-eval vs Tandem fp32 loglikelihoods: {len(pairs)} pairs, max |diff| {worst:.2e}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
