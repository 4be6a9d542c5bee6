"""One load report: the real instance's (engine/core_stats.py, in the engine-core process) and the
simulated instance (sim/instance.py) build it with the same function, so the same scheduler state
gives the same figures to the router and to the simulated router, chunked prefills (a running
request's prompt tokens still to compute) and preempted requests included."""

from __future__ import annotations

from types import SimpleNamespace

from test_sim import cost_model

from tandem.config import EngineConfig
from tandem.engine.core_stats import StepStats
from tandem.sim.instance import SimInstance
from tandem.sim.request import SimRequest

FIELDS = (
    "num_waiting",
    "num_running",
    "waiting_prefill_tokens",
    "num_preempted",
    "kv_usage",
    "kv_free_tokens",
)


def test_real_and_simulated_instance_report_the_same_load():
    now = [0.0]
    # 40 blocks of 16 tokens, 64-token chunks: prompts are prefilled in chunks and decodes run
    # the pool short, so requests are preempted (recompute) and wait again.
    cfg = EngineConfig.from_kwargs(
        max_num_batched_tokens=64, max_num_seqs=8, preemption_mode="recompute"
    )
    inst = SimInstance(
        "i0", cost_model(kv_tokens=640), cfg.scheduler_config, cfg.cache_config, lambda: now[0]
    )
    for i in range(6):
        sim = SimRequest(i, 0.0, 150 + 10 * i, 120)
        inst.add(sim, sim.prompt_token_ids(), sim.output_len, f"r{i}")
    engine = SimpleNamespace(
        scheduler=inst.scheduler,
        kv_manager=inst.kv,
        max_model_len=inst.max_model_len,
        has_unfinished_requests=lambda: inst.num_unfinished > 0,
        grammar_compiler=SimpleNamespace(),
    )
    stats = StepStats(engine, full_interval=0.0)
    seen_prefill = seen_preempted = 0
    while inst.num_unfinished:
        end = inst.start_step(now[0], float("inf"), coalesce=False)
        assert end is not None
        now[0] = end
        inst.end_step(end)
        real, simulated = stats.instance_load(), inst.state("m")
        assert {f: real[f] for f in FIELDS} == {f: getattr(simulated, f) for f in FIELDS}
        running_prompt = sum(
            max(r.num_prompt_tokens - r.num_computed_tokens, 0) for r in inst.scheduler.running
        )
        waiting = sum(r.num_tokens - r.num_computed_tokens for r in inst.scheduler.waiting)
        assert simulated.waiting_prefill_tokens == waiting + running_prompt
        seen_prefill += running_prompt > 0
        seen_preempted += simulated.num_preempted > 0
    assert seen_prefill and seen_preempted, (
        "the run never had a chunked prefill or a preempted request waiting"
    )
