"""Speculative decoding on tiny Llama / Qwen2 / Qwen3 in fp32, each proposer (n-gram, the int4
self-draft, and another model: the target truncated to its first layer), and on Gemma 3 with n-gram:
greedy output with speculation equals without it, token for token, under mixed batches, chunked
prefill, prefix hits, preemption (swap and recompute), multilevel, async on and off, n > 1, stop
tokens and max_tokens inside an accepted run, and on a P/D decode instance; a request may opt out;
seeded sampling is reproducible.

The models are the conftest ones with a small initialisation (0.1): their greedy outputs
repeat spans, so prompt lookup is accepted often and rejected often, and so is the int4 variant
of the model (each test checks both)."""

from __future__ import annotations

import json
import logging
from types import SimpleNamespace

import conftest
import pytest
import torch

from tandem import LLM, SamplingParams
from tandem.config import EngineConfig, load_yaml
from tandem.executor.kv_quant import kv_bytes_per_token
from tandem.models.config import ModelConfig
from tandem.models.loader.model_files import load_config

KINDS = ["llama", "qwen2", "qwen3", "gemma3"]
MAX_NEW = 24
# A fixed k, so every test verifies drafts (AdaptiveK would turn speculation off on these
# models, where a token costs much beside a step's fixed part: test_adaptive_k_...).
FIRST_LAYER = "<the target's first layer>"  # _llm puts the path of the target's one-layer copy here
PROPOSERS = {
    "ngram": {"method": "ngram", "num_speculative_tokens": 4, "adaptive": False},
    "self-int4": {
        "method": "draft",
        "model": "self:int4",
        "num_speculative_tokens": 4,
        "adaptive": False,
    },
    # another model: its own KV layers in the target's slots
    "first-layer": {
        "method": "draft",
        "model": FIRST_LAYER,
        "num_speculative_tokens": 4,
        "adaptive": False,
    },
}
TRUNCATED: dict[str, str] = {}  # target path -> its copy truncated to the first layer
SPEC = PROPOSERS["ngram"]
# (model, proposer): every proposer on the Llama family; Gemma 3 (sliding windows: its draft
# positions' windows) with the n-gram one, which costs no second model
KIND_PROPOSERS = [(k, p) for k in KINDS for p in PROPOSERS if k != "gemma3" or p == "ngram"]
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)


@pytest.fixture(scope="module")
def copy_models(tmp_path_factory) -> dict[str, str]:
    import transformers as tf

    out = {}
    for kind in KINDS:
        config = conftest._tiny_config(kind)
        config.initializer_range = 0.1
        torch.manual_seed(0)
        model = tf.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        path = tmp_path_factory.mktemp(f"copy-{kind}")
        model.save_pretrained(path)
        out[kind] = str(path)
        model.model.layers = model.model.layers[:1]
        model.config.num_hidden_layers = 1
        if getattr(model.config, "layer_types", None):
            model.config.layer_types = model.config.layer_types[:1]
        first = tmp_path_factory.mktemp(f"first-layer-{kind}")
        model.save_pretrained(first)
        TRUNCATED[str(path)] = str(first)
    return out


def _prompts() -> list[list[int]]:
    prompts = conftest.random_prompts(1, 5, 3, 70)
    return prompts + [prompts[0][:20] * 2]  # one that copies from its prompt


def _llm(path: str, spec: bool | str | dict, **kw) -> LLM:
    """spec: a PROPOSERS name, True (n-gram), a speculative_config, or False (off)."""
    kw.setdefault("kv_cache_memory", 1 << 22)
    spec = PROPOSERS.get(spec) if isinstance(spec, str) else SPEC if spec is True else spec or None
    if spec and spec.get("model") == FIRST_LAYER:
        spec = dict(spec, model=TRUNCATED[path])
    return LLM(path, dtype="float32", speculative_config=spec, **kw)


@pytest.fixture(scope="module")
def plain(copy_models):
    """Reference: no speculation, one batch (itself equal to HF, tests/test_engine_tiny.py)."""
    return {
        kind: conftest.token_ids(_llm(d, False).generate(_prompts(), GREEDY))
        for kind, d in copy_models.items()
    }


def _assert_drafts_accepted_and_rejected(llm: LLM) -> None:
    stats = llm.engine.core.scheduler.spec_stats
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    assert (
        llm.engine.core.stats.phase_times["propose"] > 0
    )  # the executor timed the proposals (AdaptiveK's costs)
    kv = llm.engine.core.kv_manager
    assert kv.num_free_blocks == llm.engine.core.executor.num_kv_blocks
    assert not kv.coordinator.managers[0].req_to_blocks


def _per_token(path: str) -> int:
    return kv_bytes_per_token(ModelConfig.from_hf(load_config(path)), torch.float32)


SCENARIOS = {
    "mixed-sync": dict(async_scheduling=False),
    "mixed-async": dict(async_scheduling=True),
    "chunked": dict(max_num_batched_tokens=16, block_size=8),
    "recompute": dict(block_size=4, enable_prefix_caching=False, preemption_mode="recompute"),
    "swap": dict(block_size=4, enable_prefix_caching=False, preemption_mode="swap"),
    "multilevel": dict(
        block_size=4, scheduling_policy="multilevel", max_num_seqs=3, max_num_batched_tokens=32
    ),
}


@pytest.mark.parametrize("scenario", SCENARIOS)
@pytest.mark.parametrize("kind, proposer", KIND_PROPOSERS)
def test_greedy_equals_no_speculation(kind, scenario, proposer, copy_models, plain):
    kw = dict(SCENARIOS[scenario])
    if scenario in ("recompute", "swap"):
        per_token = _per_token(copy_models[kind])
        if proposer == "first-layer":  # the draft's own layers share each block
            per_token += _per_token(TRUNCATED[copy_models[kind]])
        kw["kv_cache_memory"] = per_token * 4 * 24  # ~96 tokens: preempts
    llm = _llm(copy_models[kind], proposer, **kw)
    outs = llm.generate(_prompts(), GREEDY)
    assert conftest.token_ids(outs) == plain[kind]
    if scenario in ("recompute", "swap"):
        assert llm.engine.core.scheduler.preemptions_by_mode[scenario] > 0
    _assert_drafts_accepted_and_rejected(llm)


@pytest.mark.parametrize("kind, proposer", KIND_PROPOSERS)
def test_prefix_hits_and_n_greater_than_one(kind, proposer, copy_models, plain):
    llm = _llm(copy_models[kind], proposer, block_size=8)
    prompts = _prompts()
    first = llm.generate(prompts, GREEDY)
    again = llm.generate(
        prompts, SamplingParams(n=2, temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    )
    assert llm.engine.core.kv_manager.stats.hits > 0
    assert conftest.token_ids(first) == plain[kind]
    assert [[c.token_ids for c in o.outputs] for o in again] == [[r, r] for r in plain[kind]]
    _assert_drafts_accepted_and_rejected(llm)


@pytest.mark.parametrize("proposer", PROPOSERS)
def test_a_pd_decode_instance_speculates_on_transferred_kv(proposer, copy_models):
    """P/D: a prefill instance computes the prompt's KV and first token, the KV moves over a
    connector, and a decode instance with speculation continues: a plain run's tokens (another
    model as the draft first feeds its own KV the prompt it never saw)."""
    from test_kv_transfer import prefill

    from tandem.executor.kv_transfer import ShmTransport

    path, bs = copy_models["llama"], 8
    prompts = _prompts()
    ref = [
        o.outputs[0].token_ids for o in _llm(path, False, block_size=bs).generate(prompts, GREEDY)
    ]
    prefill_side, decode_side = (
        _llm(path, False, block_size=bs).engine,
        _llm(path, proposer, block_size=bs).engine,
    )
    conn, handoff = ShmTransport(), decode_side.core.kv_handoff
    for i, prompt in enumerate(prompts):
        first, payload = prefill(prefill_side, prompt, f"p{i}")
        conn.send(f"t{i}", payload)
        res = handoff.reserve(prompt)
        payload, _ = conn.recv(f"t{i}", timeout=30, on_layer=handoff.writer(res))
        decode_side.add_request(
            prompt + [first],
            SamplingParams(temperature=0, max_tokens=MAX_NEW - 1, ignore_eos=True),
            request_id=f"t{i}",
        )
        handoff.commit(res, payload, f"t{i}")
        tokens = []
        while decode_side.has_unfinished_requests():
            for out in decode_side.step():
                tokens = out.outputs[0].token_ids
        assert [first] + tokens == ref[i]
    assert (
        decode_side.core.kv_manager.stats.hits > 0
    )  # the transferred blocks were used, not recomputed
    _assert_drafts_accepted_and_rejected(SimpleNamespace(engine=decode_side))


@pytest.mark.parametrize("proposer", PROPOSERS)
def test_adaptive_k_keeps_greedy_output(proposer, copy_models, plain):
    llm = _llm(copy_models["llama"], dict(PROPOSERS[proposer], adaptive=True))
    outs = llm.generate(_prompts(), GREEDY)
    assert conftest.token_ids(outs) == plain["llama"]
    assert llm.engine.core.scheduler.spec_stats.num_drafts > 0  # it drafted, measured, chose


@pytest.mark.parametrize("proposer", PROPOSERS)
def test_stop_token_and_max_tokens_inside_an_accepted_run(proposer, copy_models, plain):
    """The request ends at the stop token / the max_tokens-th token even when the verify step
    accepted drafts past it."""
    ref = plain["llama"]
    llm = _llm(copy_models["llama"], proposer)
    stops = [SamplingParams(temperature=0, max_tokens=MAX_NEW, stop_token_ids=[r[10]]) for r in ref]
    lengths = [
        SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (1, 2, 5, 7, 11, 13)
    ]
    outs = llm.generate(_prompts() * 2, stops + lengths)
    for out, r in zip(outs[: len(ref)], ref):
        assert out.outputs[0].token_ids == r[: r.index(r[10]) + 1]
        assert out.outputs[0].finish_reason == "stop"
    for out, r, p in zip(outs[len(ref) :], ref, lengths):
        assert (
            out.outputs[0].token_ids == r[: p.max_tokens]
            and out.outputs[0].finish_reason == "length"
        )
    stats = llm.engine.core.scheduler.spec_stats
    assert max(i for i, n in enumerate(stats.accepted_per_pos) if n) >= 2  # runs of 3+ accepted


@pytest.mark.parametrize("proposer", PROPOSERS)
def test_opt_out_request_is_served_without_drafts(proposer, copy_models, plain):
    llm = _llm(copy_models["llama"], proposer)
    out_params = SamplingParams(
        temperature=0, max_tokens=MAX_NEW, ignore_eos=True, speculative=False
    )
    engine = llm.engine
    engine.add_request(_prompts()[-1], out_params, request_id="out")
    engine.add_request(_prompts()[-1], GREEDY, request_id="in")
    seen = {}
    while engine.has_unfinished_requests():
        for req_id in ("out", "in"):
            req = engine.core.scheduler.requests.get(req_id)
            if req is not None:
                seen[req_id] = req.spec.num_draft_tokens
        for o in engine.step():
            if o.finished:
                seen[o.request_id + "_tokens"] = o.outputs[0].token_ids
    assert seen["out"] == 0 and seen["in"] > 0
    assert seen["out_tokens"] == seen["in_tokens"] == plain["llama"][-1]


@pytest.mark.parametrize("proposer", PROPOSERS)
def test_seeded_sampling_is_reproducible(proposer, copy_models):
    llm = _llm(copy_models["llama"], proposer)
    params = [
        SamplingParams(temperature=0.02, top_p=0.9, seed=7 + i, max_tokens=MAX_NEW, ignore_eos=True)
        for i in range(len(_prompts()))
    ]
    a = conftest.token_ids(llm.generate(_prompts(), params))
    b = conftest.token_ids(llm.generate(_prompts(), params))
    assert a == b
    assert llm.engine.core.scheduler.spec_stats.num_accepted_tokens > 0


@pytest.mark.parametrize(
    "bad, message",
    [
        ({"num_speculative_tokens": 0}, r"num_speculative_tokens must be an integer in \[1, 16\]"),
        ({"num_speculative_tokens": 17}, r"num_speculative_tokens must be an integer in \[1, 16\]"),
        ({"method": "medusa"}, "unknown speculative method 'medusa'"),
        ({"method": "draft"}, "speculative method 'draft' needs a model"),
        ({"method": "draft", "model": "self:fp8"}, "self:fp8: unknown precision 'fp8'"),
        (
            {"method": "draft", "model": "self:int4", "prompt_lookup_max": 5},
            "options of method 'ngram'",
        ),
        ({"method": "ngram", "model": "smollm2-135m"}, "method 'ngram' takes no model"),
        ({"k": 4}, "unknown speculative_config key"),
    ],
)
def test_bad_speculative_config_is_refused_at_start(bad, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig.from_kwargs(speculative_config=bad)


def test_mission_yaml_section_is_accepted(tmp_path, caplog):
    path = tmp_path / "serving.yaml"
    path.write_text(
        "serving:\n  speculative_decoding:\n    draft_model: ngram\n    verify_interval: 4\n"
    )
    with caplog.at_level(logging.WARNING):
        config = EngineConfig.from_kwargs(**load_yaml(path))
    assert "not supported" not in caplog.text
    assert (config.speculative_config.method, config.speculative_config.num_speculative_tokens) == (
        "ngram",
        4,
    )
    path.write_text(
        "serving:\n  speculative_decoding:\n    draft_model: self:int4\n    verify_interval: 3\n"
    )
    spec = EngineConfig.from_kwargs(**load_yaml(path)).speculative_config
    assert (spec.method, spec.model, spec.num_speculative_tokens) == ("draft", "self:int4", 3)


def test_self_draft_of_the_targets_own_weights_is_accepted_throughout(copy_models, plain):
    """self:fp32 in an fp32 engine is the target itself (no extra weights): every draft is the
    target's greedy token, up to fp32 rounding of a one-token step against a verify chunk."""
    llm = _llm(copy_models["qwen3"], dict(PROPOSERS["self-int4"], model="self:fp32"))
    assert conftest.token_ids(llm.generate(_prompts(), GREEDY)) == plain["qwen3"]
    stats = llm.engine.core.scheduler.spec_stats
    assert stats.num_draft_tokens > 50 and stats.acceptance_rate > 0.95
    assert "draft:fp32" not in llm.engine.core.executor.variants.weight_bytes


def test_another_model_as_draft_keeps_its_own_kv(copy_models, plain, tmp_path):
    """A draft given by path is another model with KV layers of its own in the target's slots
    (the pool pays for both per block). An identical copy of the target drafts what the target
    samples, so its KV is right through prefills, catch-ups and rejected runs; greedy output
    equals no speculation (the one-layer copy's equality is in the scenario tests)."""
    import shutil

    copy = tmp_path / "same-weights"
    shutil.copytree(copy_models["qwen2"], copy)
    llm = _llm(copy_models["qwen2"], dict(PROPOSERS["first-layer"], model=str(copy)), block_size=8)
    assert conftest.token_ids(llm.generate(_prompts(), GREEDY)) == plain["qwen2"]
    stats = llm.engine.core.scheduler.spec_stats
    assert stats.num_draft_tokens > 50 and stats.acceptance_rate > 0.95
    executor = llm.engine.core.executor
    per_token = _per_token(copy_models["qwen2"])
    assert executor.num_kv_blocks == (1 << 22) // (
        2 * per_token * 8
    )  # target and draft layers alike
    assert executor.proposer.kv_caches[0].shape == executor.kv_caches[0].shape
    assert executor.proposer.kv_caches[0].data_ptr() != executor.kv_caches[0].data_ptr()
    assert f"draft:{copy}" in executor.variants.weight_bytes
    kv = llm.engine.core.kv_manager
    assert kv.num_free_blocks == executor.num_kv_blocks
    assert not kv.coordinator.managers[0].req_to_blocks


def test_self_draft_weights_are_reported(copy_models):
    variants = _llm(copy_models["llama"], "self-int4").engine.core.executor.variants
    assert 0 < variants.weight_bytes["draft:int4"] < variants.weight_bytes["fp32"]


def test_bad_draft_models_are_refused_at_start(copy_models, tmp_path):
    import transformers as tf

    config = conftest._tiny_config("llama")
    config.vocab_size = 256
    other = tmp_path / "other-vocab"
    tf.AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(other)
    draft = dict(PROPOSERS["self-int4"])
    with pytest.raises(ValueError, match="vocabulary of 256 tokens, the target's has 512"):
        _llm(copy_models["llama"], dict(draft, model=str(other)))
    # the same vocabulary size, tokens meaning other strings
    import shutil

    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel

    target, draft_dir = tmp_path / "target", tmp_path / "draft"
    shutil.copytree(copy_models["llama"], target)
    shutil.copytree(TRUNCATED[copy_models["llama"]], draft_dir)
    for folder, names in ((target, range(512)), (draft_dir, reversed(range(512)))):
        vocab = {f"t{n}": i for i, n in enumerate(names)}
        tf.PreTrainedTokenizerFast(
            tokenizer_object=Tokenizer(WordLevel(vocab, unk_token="t0"))
        ).save_pretrained(folder)
    with pytest.raises(ValueError, match="has another tokenizer than the target's"):
        _llm(str(target), dict(draft, model=str(draft_dir)))
    with pytest.raises(
        ValueError,
        match="self:bf16 computes in torch.bfloat16 but the engine's dtype is torch.float32",
    ):
        _llm(copy_models["llama"], dict(draft, model="self:bf16"))


def test_metrics_and_request_log(copy_models, tmp_path):
    from prometheus_client import generate_latest

    from tandem.server.metrics import ServerMetrics

    llm = _llm(copy_models["llama"], True)
    # what the server's metrics read: the engine core's stats (sent after each step) and its
    # precisions
    served = SimpleNamespace(
        precisions=llm.engine.precisions, weight_bytes={}, tokenizer=llm.tokenizer
    )
    metrics = ServerMetrics(served, "tiny", request_log=str(tmp_path / "requests.jsonl"))
    for out in llm.generate(_prompts()[-1:], GREEDY):
        metrics.on_finished(out)
    served.stats = llm.engine.core.scheduler_stats()
    stats = llm.engine.core.scheduler.spec_stats
    text = generate_latest(metrics.registry).decode()
    assert (
        f'tandem:spec_decode_num_drafts_total{{model_name="tiny"}} {float(stats.num_drafts)}'
        in text
    )
    assert (
        'tandem:spec_decode_num_accepted_tokens_total{model_name="tiny"} '
        f"{float(stats.num_accepted_tokens)}" in text
    )
    assert 'tandem:spec_decode_num_draft_tokens_total{model_name="tiny"}' in text
    assert (
        f'tandem:spec_decode_num_accepted_tokens_per_pos_total{{model_name="tiny",position="0"}} '
        f"{float(stats.accepted_per_pos[0])}"
    ) in text
    line = json.loads((tmp_path / "requests.jsonl").read_text())
    assert line["spec_acceptance_rate"] == pytest.approx(stats.acceptance_rate)
    assert line["spec_mean_accepted_length"] == pytest.approx(stats.mean_accepted_length)


def test_serve_flags_ask_for_the_self_draft():
    import argparse

    from tandem.server.launch import add_arguments, build_configs

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(
        [
            "--speculative-config",
            '{"method": "draft", "model": "self:int4", "num_speculative_tokens": 5}',
        ]
    )
    spec = build_configs(args)[0].speculative_config
    assert (spec.method, spec.model, spec.num_speculative_tokens, spec.num_lookahead_tokens) == (
        "draft",
        "self:int4",
        5,
        5,
    )


def test_opt_out_through_the_openai_api(copy_models, tmp_path):
    """`"speculative": false` in a completion body reaches the engine: that request verifies
    no draft (the request log has no acceptance for it), the other does, both give the same
    greedy text; a non-boolean value is a 400 and the server keeps serving."""
    import httpx
    from server_fixture import running_server

    from tandem.server.api_server import ServerConfig

    log = tmp_path / "requests.jsonl"
    engine = EngineConfig.from_kwargs(
        model=copy_models["llama"],
        dtype="float32",
        kv_cache_memory=1 << 22,
        speculative_config=SPEC,
    )
    prompt = _prompts()[-1]
    body = {
        "model": "tiny",
        "prompt": prompt,
        "max_tokens": MAX_NEW,
        "temperature": 0,
        "ignore_eos": True,
    }
    with running_server(engine, ServerConfig(model_name="tiny", request_log=str(log))) as (url, _):
        texts = {}
        for name, extra in (("out", {"speculative": False}), ("in", {})):
            r = httpx.post(url + "/v1/completions", json={**body, **extra}, timeout=60)
            assert r.status_code == 200, r.text
            texts[name] = r.json()["choices"][0]["text"]
        bad = httpx.post(
            url + "/v1/completions", json={**body, "speculative": "sometimes"}, timeout=60
        )
        assert bad.status_code == 400 and "speculative" in bad.text
        assert httpx.post(url + "/v1/completions", json=body, timeout=60).status_code == 200
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    assert "spec_acceptance_rate" not in lines[0] and "spec_acceptance_rate" in lines[1]
    assert texts["out"] == texts["in"]
