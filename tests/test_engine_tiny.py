"""Greedy output equals Hugging Face transformers on tiny random Llama / Qwen2 / Qwen3 models,
in every batching situation: mixed lengths, chunked prefill, preemption, prefix hits, n > 1,
aborts and stops; with async scheduling (step N+1 scheduled while step N runs) and without."""

from __future__ import annotations

import pytest
import torch
from conftest import hf_greedy, random_prompts, token_ids

from tandem import LLM, SamplingParams
from tandem.executor.kv_quant import kv_bytes_per_token
from tandem.models.config import ModelConfig
from tandem.models.loader.model_files import load_config

KINDS = ["llama", "qwen2", "qwen3", "mistral", "gemma3"]
MAX_NEW = 12


@pytest.fixture(scope="module")
def references(tiny_model_dirs):
    prompts = random_prompts(1, 6, 3, 70)
    shared = random_prompts(2, 1, 40, 40)[0]
    prefixed = [shared + p for p in random_prompts(3, 3, 2, 9)]
    return {
        kind: (prompts, hf_greedy(d, prompts, MAX_NEW), prefixed, hf_greedy(d, prefixed, MAX_NEW))
        for kind, d in tiny_model_dirs.items()
    }


def _llm(path: str, **kw) -> LLM:
    kw.setdefault("dtype", "float32")
    kw.setdefault("kv_cache_memory", 1 << 22)
    return LLM(path, **kw)


GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
ASYNC = pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])


def _assert_all_blocks_free(llm: LLM) -> None:
    kv = llm.engine.core.kv_manager
    assert kv.num_free_blocks == llm.engine.core.executor.num_kv_blocks
    assert not kv.coordinator.managers[0].req_to_blocks
    kv.host_tier.release_pending_host_blocks()
    assert kv.host_tier.num_free_host_blocks == kv.host_tier.num_host_blocks


def _run(engine) -> dict[str, list[int]]:
    """Step until done; the token ids of each finished request."""
    results = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                results[out.request_id] = out.outputs[0].token_ids
    return results


@ASYNC
@pytest.mark.parametrize("kind", KINDS)
def test_mixed_batch_matches_hf(kind, async_scheduling, tiny_model_dirs, references):
    prompts, ref, _, _ = references[kind]
    llm = _llm(tiny_model_dirs[kind], async_scheduling=async_scheduling)
    outs = llm.generate(prompts, GREEDY)
    assert token_ids(outs) == ref
    _assert_all_blocks_free(llm)


@ASYNC
@pytest.mark.parametrize("kind", KINDS)
def test_chunked_prefill_matches_hf(kind, async_scheduling, tiny_model_dirs, references):
    prompts, ref, _, _ = references[kind]
    llm = _llm(
        tiny_model_dirs[kind],
        max_num_batched_tokens=16,
        block_size=8,
        async_scheduling=async_scheduling,
    )
    outs = llm.generate(prompts, GREEDY)
    assert token_ids(outs) == ref


@ASYNC
@pytest.mark.parametrize("mode", ["recompute", "swap"])
@pytest.mark.parametrize("kind", KINDS)
def test_preemption_matches_hf(kind, mode, async_scheduling, tiny_model_dirs, references):
    prompts, ref, _, _ = references[kind]
    per_token = kv_bytes_per_token(
        ModelConfig.from_hf(load_config(tiny_model_dirs[kind])), torch.float32
    )
    # Room for the longest request alone (~82 tokens), far less than all six at once. Gemma 3's
    # sliding layers free their blocks behind the window (KV groups): in chunks of 32 tokens, a
    # pool of 16 blocks' worth holds the longest request and still preempts.
    sliding = {"max_num_batched_tokens": 32} if kind == "gemma3" else {}
    llm = _llm(
        tiny_model_dirs[kind],
        block_size=4,
        kv_cache_memory=per_token * 4 * (16 if sliding else 24),
        enable_prefix_caching=False,
        preemption_mode=mode,
        async_scheduling=async_scheduling,
        **sliding,
    )
    outs = llm.generate(prompts, GREEDY)
    assert llm.engine.core.scheduler.preemptions_by_mode[mode] > 0
    assert token_ids(outs) == ref
    _assert_all_blocks_free(llm)


@ASYNC
@pytest.mark.parametrize("mode", ["recompute", "swap", "auto"])
def test_multilevel_preemption_matches_hf(mode, async_scheduling, tiny_model_dirs, references):
    """Interactive requests arriving while the batch is full preempt standard/background
    ones; every request still gets exactly its single-request greedy tokens."""
    prompts, ref, _, _ = references["llama"]
    per_token = kv_bytes_per_token(
        ModelConfig.from_hf(load_config(tiny_model_dirs["llama"])), torch.float32
    )
    llm = _llm(
        tiny_model_dirs["llama"],
        block_size=4,
        kv_cache_memory=per_token * 4 * 30,
        max_num_seqs=3,
        scheduling_policy="multilevel",
        preemption_mode=mode,
        async_scheduling=async_scheduling,
    )
    engine = llm.engine
    for i, p in enumerate(prompts[:3]):
        engine.add_request(p, GREEDY, request_id=f"bg{i}", priority=3 if i else 2)
    for _ in range(3):
        engine.step()
    for i, p in enumerate(prompts[3:]):
        engine.add_request(p, GREEDY, request_id=f"chat{i}", priority=1)
    results = _run(engine)
    assert engine.core.scheduler.num_preemptions > 0
    assert [results[f"bg{i}"] for i in range(3)] + [results[f"chat{i}"] for i in range(3)] == ref
    _assert_all_blocks_free(llm)


@ASYNC
@pytest.mark.parametrize("kind", KINDS)
def test_prefix_cache_hits_match_hf(kind, async_scheduling, tiny_model_dirs, references):
    _, _, prefixed, ref = references[kind]
    llm = _llm(tiny_model_dirs[kind], block_size=8, async_scheduling=async_scheduling)
    first = llm.generate(prefixed[:1], GREEDY)
    rest = llm.generate(prefixed[1:], GREEDY)
    stats = llm.engine.core.kv_manager.stats
    assert stats.hits >= 2 * 40 // 8 * 8  # both later prompts reuse the 40-token shared prefix
    assert token_ids(first + rest) == ref
    assert all(o.metrics.num_cached_tokens >= 0 for o in rest)


@ASYNC
@pytest.mark.parametrize("kind", ["llama"])
def test_n_greater_than_one_shares_prompt(kind, async_scheduling, tiny_model_dirs, references):
    prompts, ref, _, _ = references[kind]
    llm = _llm(tiny_model_dirs[kind], block_size=4, async_scheduling=async_scheduling)
    params = SamplingParams(n=3, temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    outs = llm.generate(prompts[:2], params)
    for out, r in zip(outs, ref[:2]):
        assert [c.token_ids for c in out.outputs] == [r] * 3
    assert llm.engine.core.kv_manager.stats.hits > 0
    _assert_all_blocks_free(llm)


@ASYNC
def test_abort_mid_flight_leaves_the_rest_intact(async_scheduling, tiny_model_dirs, references):
    """Aborting requests while steps run (one is in flight under async scheduling): the
    others keep their greedy tokens and every block comes back."""
    prompts, ref, _, _ = references["llama"]
    llm = _llm(tiny_model_dirs["llama"], block_size=4, async_scheduling=async_scheduling)
    engine = llm.engine
    for i, p in enumerate(prompts):
        engine.add_request(p, GREEDY, request_id=f"r{i}")
    for _ in range(4):
        engine.step()
    aborted = engine.abort_request("r1")
    engine.step()
    engine.abort_request("r4")
    results = _run(engine)
    assert aborted.finished and aborted.outputs[0].finish_reason == "abort"
    assert results == {f"r{i}": ref[i] for i in (0, 2, 3, 5)}
    _assert_all_blocks_free(llm)


@ASYNC
def test_stops_drop_the_token_after_them(async_scheduling, tiny_model_dirs, references):
    """A stop token (like EOS) ends a request in the step that samples it; under async
    scheduling the request is already in the next step, whose token must not show."""
    prompts, ref, _, _ = references["llama"]
    llm = _llm(tiny_model_dirs["llama"], block_size=4, async_scheduling=async_scheduling)
    stops = [SamplingParams(temperature=0, max_tokens=MAX_NEW, stop_token_ids=[r[3]]) for r in ref]
    outs = llm.generate(prompts, stops)
    for out, r in zip(outs, ref):
        assert out.outputs[0].token_ids == r[: r.index(r[3]) + 1]
        assert out.outputs[0].finish_reason == "stop"
    _assert_all_blocks_free(llm)
    assert token_ids(llm.generate(prompts, GREEDY)) == ref  # and it serves on


def test_an_idle_wait_is_no_gap_when_a_step_for_nobody_was_left_in_flight(tiny_model_dirs):
    """A stop token ends a request while the step after it is already scheduled (async): that
    step is still in flight when generate returns. The engine's wait for the next request is
    idle time, not a gap between steps (a gap is charged to the next step's cost in AdaptiveK)."""
    import time

    llm = _llm(tiny_model_dirs["llama"], async_scheduling=True)
    out = llm.generate([[4, 5, 6]], GREEDY)[0].outputs[0].token_ids
    llm.generate(
        [[4, 5, 6]], SamplingParams(temperature=0, max_tokens=MAX_NEW, stop_token_ids=[out[3]])
    )
    assert len(llm.engine.core.pipeline) == 1  # the step planned past the stop token
    time.sleep(0.5)
    llm.engine.core.stats.reset()
    llm.generate([[7, 8, 9]], GREEDY)
    assert llm.engine.core.stats.phase_times["gap"] < 0.25


def test_seeded_sampling_reproducible_across_batches(tiny_model_dirs):
    llm = _llm(tiny_model_dirs["llama"])
    prompts = random_prompts(5, 5, 4, 30)
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=10, ignore_eos=True)
    other = SamplingParams(temperature=1.0, max_tokens=10, ignore_eos=True)
    alone = llm.generate(prompts[0], seeded)[0].outputs[0].token_ids
    mixed = llm.generate(prompts, [other, other, seeded, other, other])
    assert (
        mixed[2].outputs[0].token_ids != []
        and llm.generate(prompts[2], seeded)[0].outputs[0].token_ids
        == mixed[2].outputs[0].token_ids
    )
    again = llm.generate([prompts[1], prompts[0]], [other, seeded])
    assert again[1].outputs[0].token_ids == alone


def test_failed_step_drops_the_steps_planned_on_it():
    from tandem.core.outputs import ModelRunnerOutput, SchedulerOutput
    from tandem.engine.step_pipeline import StepPipeline

    ran = []

    def execute(sched):
        ran.append(sched)
        if len(ran) == 1:
            raise RuntimeError("step failed")
        return ModelRunnerOutput()

    pipeline = StepPipeline(execute, overlap=True)
    pipeline.submit(SchedulerOutput())
    pipeline.submit(SchedulerOutput())
    with pytest.raises(RuntimeError, match="step failed"):
        pipeline.pop()
    assert len(pipeline) == 0 and len(ran) == 2  # the second ran, and was dropped
    pipeline.submit(SchedulerOutput())
    assert pipeline.pop().result == ModelRunnerOutput()
    pipeline.shutdown()


class _RecordingCore:
    """Stands in for EngineCore under the engine-core loop's command handling: records the calls."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []

    def add_request(self, request):
        self.calls.append(("add", request.request_id))

    def abort_requests(self, request_ids, status):
        self.calls.append(("abort", request_ids[0]))


def _command_handler():
    from tandem.engine.core_messages import AbortRequests, EngineCoreRequest
    from tandem.engine.core_proc import EngineCoreProc

    proc = EngineCoreProc.__new__(EngineCoreProc)  # no sockets: the commands are fed by hand
    proc.core, proc._held, sent, inbox = _RecordingCore(), [], [], []
    proc._send = sent.append

    def pending(timeout_ms):
        taken = list(inbox)
        inbox.clear()
        return taken

    proc._pending = pending

    def add(rid):
        inbox.append(EngineCoreRequest(rid, [1, 2], [SamplingParams()], 0.0, 2, "fp32"))

    def abort(rid):
        inbox.append(AbortRequests([rid]))

    return proc, add, abort


def test_arrivals_between_steps_keep_command_order():
    """Between overlapped steps only adds are taken, up to the first abort; the abort and
    everything behind it (even an add) run at the next drain, in order."""
    proc, add, abort = _command_handler()
    add("a")
    abort("x")
    add("b")
    proc._admit_arrivals()
    assert proc.core.calls == [("add", "a")]
    proc._drain(0)
    assert proc.core.calls == [("add", "a"), ("abort", "x"), ("add", "b")]


def test_on_add_runs_also_when_the_add_is_refused(tiny_model_dirs):
    """P/D commits received KV in on_add; a refused add must still let it run, or the
    reservation it holds is never released."""
    from tandem.engine.core_messages import EngineCoreRequest, ReleaseKV

    core = _llm(tiny_model_dirs["llama"]).engine.core
    seen = []

    class Hook:
        def on_add(self, request_id, kv_transfer, accepted):
            seen.append((request_id, kv_transfer, accepted))

    core.register_utilities({}, Hook().on_add)
    with pytest.raises(
        ValueError, match="no engine-core utility answers ReleaseKV here"
    ):  # no P/D offline
        core.utility(ReleaseKV("t"))
    variant = core.executor.variants.default
    req = EngineCoreRequest("r", [1, 2], [SamplingParams()], 0.0, 2, variant, kv_transfer={"t": 1})
    core.add_request(req)
    with pytest.raises(ValueError, match="duplicate"):
        core.add_request(req)
    core.add_request(EngineCoreRequest("plain", [1, 2], [SamplingParams()], 0.0, 2, variant))
    assert seen == [("r", {"t": 1}, True), ("r", {"t": 1}, False)]
    core.abort_requests(["r", "plain"])
    assert not core.has_unfinished_requests()


def test_step_trace_has_a_line_per_step_and_summarizes(tmp_path, tiny_model_dirs, capsys):
    import argparse
    import json

    from tandem.bench import steps as bench_steps

    path = tmp_path / "steps.jsonl"
    llm = _llm(tiny_model_dirs["llama"], step_trace=str(path), max_num_batched_tokens=16)
    prompts = random_prompts(3, 3, 20, 30)
    llm.generate(prompts, SamplingParams(max_tokens=5, ignore_eos=True))
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(lines) == llm.engine.core.stats.num_steps and all(s["seconds"] > 0 for s in lines)
    # every prompt token once, then one token per step for each of the 4 later outputs
    assert sum(s["tokens"] for s in lines) == sum(map(len, prompts)) + 3 * 4
    assert max(s["tokens"] for s in lines) <= 16
    summary = bench_steps.summarize(lines)
    assert summary["other prefill"]["steps"] + summary["decode only"]["steps"] == len(lines)
    assert abs(sum(s["busy_share"] for s in summary.values()) - 1) < 1e-9
    bench_steps.main(argparse.Namespace(trace=path))
    assert "decode only" in capsys.readouterr().out
    (tmp_path / "bad.jsonl").write_text("{not json\n")
    with pytest.raises(ValueError, match="bad.jsonl:1: not JSON"):
        bench_steps.main(argparse.Namespace(trace=tmp_path / "bad.jsonl"))


def test_the_engine_seed_fixes_the_stream_of_unseeded_requests(tiny_model_dirs):
    params = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)

    def sampled(seed: int) -> list[int]:
        out = _llm(tiny_model_dirs["llama"], seed=seed).generate([1, 2, 3], params)[0]
        return out.outputs[0].token_ids

    first = sampled(5)
    assert sampled(5) == first and sampled(6) != first
