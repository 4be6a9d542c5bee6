"""Bad input gets a clear error that names the problem, and running requests are unaffected."""

from __future__ import annotations

import pytest

from tandem import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_model_dirs):
    return LLM(
        tiny_model_dirs["llama"], dtype="float32", kv_cache_memory=1 << 20, max_model_len=128
    )


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(temperature=-0.5), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(top_k=-3), "top_k"),
        (dict(n=0), "n must"),
        (dict(min_p=2.0), "min_p"),
        (dict(presence_penalty=5.0), "presence_penalty"),
        (dict(logprobs=99), "logprobs"),
    ],
)
def test_invalid_sampling_params(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_bad_requests_do_not_disturb_running_ones(llm):
    engine = llm.engine
    ref = llm.generate([[5, 6, 7, 8]], GREEDY)[0].outputs[0].token_ids
    rid = engine.add_request([5, 6, 7, 8], GREEDY)
    engine.step()
    bad = [
        ([], "empty"),
        ([1] * 200, "prompt has 200 tokens"),
        ([10_000], "outside the vocabulary"),
        ("text", "no tokenizer"),
        ([1.5], "token ids"),
    ]
    for prompt, match in bad:
        with pytest.raises(ValueError, match=match):
            engine.add_request(prompt, GREEDY)
    with pytest.raises(ValueError, match="duplicate"):
        engine.add_request([1, 2], GREEDY, request_id=rid)
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final = out
    assert final.request_id == rid and final.outputs[0].token_ids == ref
    assert engine.core.kv_manager.num_free_blocks == engine.core.executor.num_kv_blocks


def test_generate_rejects_batch_without_running_any(llm):
    with pytest.raises(ValueError, match="empty"):
        llm.generate([[1, 2, 3], []], GREEDY)
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.core.kv_manager.num_free_blocks == llm.engine.core.executor.num_kv_blocks


@pytest.mark.parametrize(
    "model,match",
    [
        ("/no/such/model", "no/such/model"),
        ("not-an-alias", "not-an-alias"),
    ],
)
def test_unknown_model(model, match):
    with pytest.raises((ValueError, FileNotFoundError), match=match):
        LLM(model)


def test_engine_options_validated(tiny_model_dirs):
    with pytest.raises(ValueError, match="block_size"):
        LLM(tiny_model_dirs["llama"], block_size=10)
    with pytest.raises(ValueError, match="kv_cache_memory"):
        LLM(tiny_model_dirs["llama"], kv_cache_memory=-1)
    with pytest.raises(ValueError, match="holds no KV block"):
        LLM(tiny_model_dirs["llama"], kv_cache_memory=10)


def test_cli_reports_errors_without_traceback(capsys):
    from tandem.cli import main

    assert main(["generate", "--model", "/no/such/model", "--prompt", "hi"]) == 2
    assert "error:" in capsys.readouterr().err
