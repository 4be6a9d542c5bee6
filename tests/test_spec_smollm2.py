"""Speculative decoding on the real default model, SmolLM2-135M in fp32, with each proposer
(n-gram, and the int4 self-draft): greedy tokens equal speculation off on the shipped grounded
and chat prompts, batched and chunked, and a stop string inside an accepted run ends the text
and the tokens where speculation off does."""

from __future__ import annotations

import pytest

from tandem import LLM, SamplingParams
from tandem.bench.spec_runner import load_prompt_sets

pytestmark = pytest.mark.slow
MAX_NEW = 48
PROPOSERS = {"ngram": {"method": "ngram"}, "self-int4": {"method": "draft", "model": "self:int4"}}


@pytest.fixture(scope="module")
def off():
    from tandem.models.loader.model_files import resolve_model

    path = str(resolve_model("smollm2-135m"))
    sets = load_prompt_sets()
    chats = [[{"role": "user", "content": p}] for p in sets["grounded"][:3] + sets["chat"][:2]]
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    llm = LLM(path, dtype="float32", quantization="fp32", kv_cache_memory=64 << 20)
    return (
        llm,
        chats,
        params,
        [o.outputs[0] for o in llm.chat(chats, params)],
    )  # the reference, run once


@pytest.fixture(scope="module", params=PROPOSERS)
def runs(request, off):
    llm, chats, params, ref = off
    on = LLM(
        str(llm.engine.core.model_dir),
        dtype="float32",
        quantization="fp32",
        kv_cache_memory=64 << 20,
        max_num_batched_tokens=64,
        speculative_config=dict(PROPOSERS[request.param], num_speculative_tokens=4, adaptive=False),
    )
    return llm, on, chats, params, ref


def test_greedy_equals_no_speculation(runs):
    off, on, chats, params, ref = runs
    assert [o.outputs[0].token_ids for o in on.chat(chats, params)] == [r.token_ids for r in ref]
    stats = on.engine.core.scheduler.spec_stats
    assert (
        stats.num_accepted_tokens > 0.3 * stats.num_draft_tokens
    )  # the grounded prompts copy; int4 agrees


def test_stop_string_inside_an_accepted_run(runs):
    off, on, chats, params, ref = runs
    words = ref[0].text.split()
    stop = " ".join(words[len(words) // 2 : len(words) // 2 + 2])  # a stop string mid-output
    stop_params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, stop=[stop])
    a = off.chat(chats[:1], stop_params)[0].outputs[0]
    b = on.chat(chats[:1], stop_params)[0].outputs[0]
    assert a.finish_reason == b.finish_reason == "stop" and a.stop_reason == stop
    assert (b.text, b.token_ids) == (a.text, a.token_ids)
