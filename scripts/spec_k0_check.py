"""Does k = 0 cost nothing? Speculation off against n-gram with AdaptiveK held at k = 0, in one
process, alternating, batch 32 chat, greedy, 96 tokens (docs/benchmarks.md section 22).
Run: .venv/bin/python scripts/spec_k0_check.py"""
import time, resource
from tandem import LLM, SamplingParams
from tandem.bench.spec import load_prompt_sets
chat = load_prompt_sets()["chat"]
prompts = [[{"role": "user", "content": chat[i % len(chat)]}] for i in range(32)]
params = SamplingParams(temperature=0, max_tokens=96)
off = LLM("smollm2-135m", max_num_seqs=64, enable_prefix_caching=False)
on = LLM("smollm2-135m", max_num_seqs=64, enable_prefix_caching=False,
         speculative_config={"method": "ngram", "num_speculative_tokens": 4})
on.engine.core.scheduler.spec_policy.choose = lambda num_decodes: 0  # k = 0 always
res = {"off": [], "k0": []}
for llm in (off, on):
    llm.chat(prompts[:2], SamplingParams(max_tokens=8))
for rnd in range(3):
    for name, llm in (("off", off), ("k0", on)):
        st = llm.engine.core.stats; st.reset()
        t = time.perf_counter(); outs = llm.chat(prompts, params); s = time.perf_counter() - t
        n = sum(len(o.outputs[0].token_ids) for o in outs)
        res[name].append(n / s)
        print(f"{name} round {rnd}: {n / s:.1f} tok/s, execute {st.phase_times['execute'] / st.num_steps * 1e3:.1f} ms/step, "
              f"gap {st.phase_times['gap'] / st.num_steps * 1e3:.2f} ms/step, steps {st.num_steps}", flush=True)
print("k0/off per round:", [round(b / a, 3) for a, b in zip(res["off"], res["k0"])],
      "peak RSS", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024, "MiB")
