"""Speculation off, n-gram and self:int4 (adaptive k) in one process, alternating per batch size
(chat set, greedy, 96 tokens, two rounds): batch 32 / 64 ratios without the noise of running
off and on one after another in separate processes (docs/benchmarks.md section 22).
Run: .venv/bin/python scripts/spec_interleaved.py"""
import time, resource
from tandem import LLM, SamplingParams
from tandem.bench.spec import load_prompt_sets
chat = load_prompt_sets()["chat"]
params = SamplingParams(temperature=0, max_tokens=96)
kw = dict(max_num_seqs=64, enable_prefix_caching=False)
llms = {"off": LLM("smollm2-135m", **kw),
        "ngram": LLM("smollm2-135m", speculative_config={"method": "ngram", "num_speculative_tokens": 4}, **kw),
        "self:int4": LLM("smollm2-135m", speculative_config={"method": "draft", "model": "self:int4", "num_speculative_tokens": 4}, **kw)}
for llm in llms.values():
    llm.chat([{"role": "user", "content": "Hello"}], SamplingParams(max_tokens=4))
for rnd in range(2):
    for batch in (32, 64):
        prompts = [[{"role": "user", "content": chat[i % len(chat)]}] for i in range(batch)]
        rate = {}
        for name, llm in llms.items():
            sd = llm.engine.core.scheduler.spec_stats; before = sd.num_drafts
            t = time.perf_counter(); outs = llm.chat(prompts, params); s = time.perf_counter() - t
            rate[name] = sum(len(o.outputs[0].token_ids) for o in outs) / s
            rate[name + " verifies"] = sd.num_drafts - before
        print(f"round {rnd} batch {batch}: off {rate['off']:.1f} tok/s; ngram {rate['ngram']:.1f} ({rate['ngram'] / rate['off']:.3f}x, "
              f"{rate['ngram verifies']} verifies); self:int4 {rate['self:int4']:.1f} ({rate['self:int4'] / rate['off']:.3f}x, "
              f"{rate['self:int4 verifies']} verifies)", flush=True)
print("peak RSS", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024, "MiB")
