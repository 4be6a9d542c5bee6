"""Grammar-constrained decoding through the offline API on a tiny random model: every kind of
constraint holds, greedy output is unchanged where it already satisfied the constraint, and the
matchers survive async scheduling, preemption (swap and recompute), n > 1 and stop strings."""

from __future__ import annotations

import json
import random
import re

import jsonschema
import pytest
import torch
from conftest import token_ids
from structured_fixture import with_tokenizer

from tandem import LLM, SamplingParams
from tandem.core.sampling_params import StructuredOutputsParams
from tandem.executor.kv_quant import kv_bytes_per_token
from tandem.models.config import ModelConfig
from tandem.models.loader.model_files import load_config

SCHEMA = {
    "type": "object",
    "properties": {
        "a": {"enum": ["x", "y"]},
        "n": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["a", "n"],
    "additionalProperties": False,
}
ASYNC = pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])


@pytest.fixture(scope="module")
def model_dir(tiny_model_dirs, tmp_path_factory):
    return with_tokenizer(tiny_model_dirs["llama"], tmp_path_factory.mktemp("so") / "tiny-tok")


def _prompts(n: int, seed: int = 7) -> list[list[int]]:
    """Like conftest's random_prompts, without token 0: the tokenizer's EOS."""
    rng = random.Random(seed)
    return [[rng.randrange(1, 512) for _ in range(rng.randint(3, 40))] for _ in range(n)]


def _llm(path: str, **kw) -> LLM:
    kw.setdefault("dtype", "float32")
    kw.setdefault("kv_cache_memory", 1 << 22)
    return LLM(path, **kw)


def _params(so: StructuredOutputsParams | None, **kw) -> SamplingParams:
    kw.setdefault("temperature", 0)
    kw.setdefault("max_tokens", 24)
    return SamplingParams(structured_outputs=so, **kw)


def _check(so: StructuredOutputsParams, text: str, finish: str) -> None:
    """A finished output satisfies its constraint; one cut by max_tokens is a prefix of one."""
    if so.choice is not None:
        assert text in so.choice if finish == "stop" else any(c.startswith(text) for c in so.choice)
    elif so.regex is not None and finish == "stop":
        assert re.fullmatch(so.regex, text), text
    elif so.json is not None and finish == "stop":
        jsonschema.validate(json.loads(text), so.json)
    elif so.json_object and finish == "stop":
        assert isinstance(json.loads(text), dict)


KINDS = [
    StructuredOutputsParams(json=SCHEMA),
    StructuredOutputsParams(json_object=True),
    StructuredOutputsParams(regex=r"(ab|cd)[0-9]{2,4}"),
    StructuredOutputsParams(choice=["yes", "no", "maybe"]),
    StructuredOutputsParams(grammar='root ::= "[" item ("," item)* "]"\nitem ::= [0-9]+'),
]


@ASYNC
def test_every_kind_of_constraint_holds(model_dir, async_scheduling):
    llm = _llm(model_dir, async_scheduling=async_scheduling)
    prompts = _prompts(4)
    outs = llm.generate(
        prompts * len(KINDS), [_params(so, max_tokens=40) for so in KINDS for _ in prompts]
    )
    finished = 0
    for i, out in enumerate(outs):
        c = out.outputs[0]
        _check(KINDS[i // len(prompts)], c.text, c.finish_reason)
        finished += c.finish_reason == "stop"
    assert finished >= len(outs) // 2  # most end by the grammar, not by max_tokens


@ASYNC
def test_greedy_output_unchanged_where_it_already_satisfied_the_constraint(
    model_dir, async_scheduling
):
    llm = _llm(model_dir, async_scheduling=async_scheduling)
    prompts = _prompts(6, seed=3)
    plain = llm.generate(prompts, _params(None, max_tokens=12, ignore_eos=True))
    texts = [o.outputs[0].text for o in plain]
    assert all(len(o.outputs[0].token_ids) == 12 and 0 not in o.outputs[0].token_ids for o in plain)
    # Constraints built to accept the unconstrained text: the literal, or a choice including it.
    cons = [
        StructuredOutputsParams(choice=[t, t[:-1] + "~" if t[-1] != "~" else t + "!"])
        for t in texts
    ]
    outs = llm.generate(prompts, [_params(so, max_tokens=12, ignore_eos=True) for so in cons])
    assert token_ids(outs) == token_ids(plain)


@ASYNC
@pytest.mark.parametrize(
    "policy, mode", [("fcfs", "recompute"), ("fcfs", "swap"), ("multilevel", "auto")]
)
def test_matchers_survive_preemption(model_dir, policy, mode, async_scheduling):
    prompts = _prompts(6, seed=11)
    sos = [KINDS[0], KINDS[2], KINDS[4]] * 2
    params = [_params(so, max_tokens=30) for so in sos]
    ref = token_ids(_llm(model_dir).generate(prompts, params))
    per_token = kv_bytes_per_token(ModelConfig.from_hf(load_config(model_dir)), torch.float32)
    llm = _llm(
        model_dir,
        block_size=4,
        kv_cache_memory=per_token * 4 * 24,
        enable_prefix_caching=False,
        preemption_mode=mode,
        scheduling_policy=policy,
        async_scheduling=async_scheduling,
    )
    outs = llm.generate(prompts, params)
    assert llm.engine.core.scheduler.num_preemptions > 0
    assert token_ids(outs) == ref
    for so, o in zip(sos, outs):
        _check(so, o.outputs[0].text, o.outputs[0].finish_reason)


def test_every_sampling_mode_in_one_batch(model_dir):
    llm = _llm(model_dir)
    so = KINDS[0]
    modes = [
        dict(temperature=0.7, top_k=5),
        dict(temperature=1.0, min_p=0.2, seed=4),
        dict(repetition_penalty=1.3),
        dict(frequency_penalty=1.0, presence_penalty=0.5),
        dict(temperature=0.9, top_p=0.5, logprobs=2),
    ]
    outs = llm.generate(_prompts(len(modes)), [_params(so, max_tokens=40, **m) for m in modes])
    for out in outs:
        _check(so, out.outputs[0].text, out.outputs[0].finish_reason)
    assert all(len(entry) == 3 for entry in outs[-1].outputs[0].logprobs)


@ASYNC
def test_n_greater_than_one_with_sampling_and_chunked_prefill(model_dir, async_scheduling):
    llm = _llm(
        model_dir, max_num_batched_tokens=16, block_size=8, async_scheduling=async_scheduling
    )
    so = KINDS[0]
    outs = llm.generate(
        _prompts(3, seed=5), _params(so, n=4, temperature=1.0, top_p=0.9, seed=1, max_tokens=40)
    )
    for out in outs:
        assert len(out.outputs) == 4
        for c in out.outputs:
            _check(so, c.text, c.finish_reason)


def test_stop_string_and_unsatisfiable_grammar(model_dir):
    llm = _llm(model_dir)
    # The grammar wants 50 digits, max_tokens allows fewer: ends by length, no crash.
    long = llm.generate(
        _prompts(1), _params(StructuredOutputsParams(regex="[0-9]{50}"), max_tokens=5)
    )[0]
    assert long.outputs[0].finish_reason == "length" and re.fullmatch(
        "[0-9]*", long.outputs[0].text
    )
    # A stop string ends a constrained request as it ends any other.
    so = StructuredOutputsParams(regex="abc[0-9]+")
    out = llm.generate(_prompts(1), _params(so, stop=["c"]))[0]
    assert out.outputs[0].text == "ab" and out.outputs[0].finish_reason == "stop"


# 40 objects of 50 enum fields each: over a second to compile, refused past a 0.2 s bound.
HUGE = {
    "type": "object",
    "properties": {
        f"p{i}": {
            "type": "object",
            "properties": {f"q{j}": {"enum": [f"v{k}" for k in range(50)]} for j in range(50)},
            "required": [f"q{j}" for j in range(50)],
        }
        for i in range(40)
    },
}


@pytest.mark.parametrize(
    "so, words",
    [
        (
            StructuredOutputsParams(json={"type": "nope"}),
            'invalid json constraint: Unsupported type "nope"',
        ),
        (StructuredOutputsParams(regex="a(b"), "invalid regex constraint: .*parenthesis"),
        (
            StructuredOutputsParams(grammar="root ::= ("),
            "invalid grammar constraint: EBNF parser error",
        ),
        (StructuredOutputsParams(json=HUGE), "did not compile within 0.2 s"),
    ],
)
def test_bad_constraints_are_refused_and_the_engine_keeps_serving(model_dir, so, words):
    llm = _llm(model_dir)
    llm.engine.core.grammar_compiler.timeout_s = 0.2
    with pytest.raises(ValueError, match=words):
        llm.generate(_prompts(1), _params(so))
    assert not llm.engine.has_unfinished_requests()
    assert llm.generate(_prompts(1), _params(KINDS[3]))[0].outputs[0].text in KINDS[3].choice


def test_structured_outputs_params_validation():
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams(json=SCHEMA, regex="a")
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match="non-empty list"):
        StructuredOutputsParams(choice=[])
    with pytest.raises(ValueError, match="not valid JSON"):
        StructuredOutputsParams(json="{nope")
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(min_tokens=2, structured_outputs=StructuredOutputsParams(regex="a+"))
    assert (
        StructuredOutputsParams(json={"b": 1, "a": 2}).key
        == StructuredOutputsParams(json='{"b":1,  "a":2}').key
    )


def test_compiled_grammars_are_cached_by_text(model_dir):
    llm = _llm(model_dir)
    compiler = llm.engine.core.grammar_compiler
    first = compiler.compile(StructuredOutputsParams(json=SCHEMA))
    assert compiler.compile(StructuredOutputsParams(json=json.dumps(SCHEMA, indent=2))) is first
    assert compiler.compile(StructuredOutputsParams(regex="a+")) is not first


def test_a_model_without_tokenizer_refuses_constraints(tiny_model_dirs):
    llm = _llm(tiny_model_dirs["llama"])
    with pytest.raises(ValueError, match="tokenizer"):
        llm.generate([[1, 2, 3]], _params(KINDS[2]))


def test_step_trace_carries_the_masking_cost(model_dir, tmp_path, capsys):
    import argparse

    from tandem.bench import steps as bench_steps

    path = tmp_path / "steps.jsonl"
    llm = _llm(model_dir, step_trace=str(path))
    llm.generate(
        _prompts(4),
        [_params(KINDS[0] if i % 2 else None, max_tokens=8, ignore_eos=True) for i in range(4)],
    )
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert all(0 < s["structured_output_seconds"] < s["seconds"] for s in lines)
    bench_steps.main(argparse.Namespace(trace=path))
    assert f"grammar masks: {len(lines)} steps" in capsys.readouterr().out


@pytest.mark.parametrize("spec", [{"method": "ngram"}, {"method": "draft", "model": "self:int4"}])
def test_speculation_drafts_nothing_for_constrained_requests(model_dir, spec):
    """With speculation on (n-gram, or the int4 self-draft), a constrained request still
    satisfies its constraint and is never drafted for (a draft would skip the grammar's mask);
    an unconstrained request on the same prompt is. The prompt repeats a span so prompt lookup
    has matches."""
    # k fixed (adaptive off): AdaptiveK would start with plain steps and might never draft here
    llm = _llm(model_dir, speculative_config=dict(spec, num_speculative_tokens=3, adaptive=False))
    repeat = [5, 6, 7, 8] * 10
    stats = llm.engine.core.scheduler.spec_stats
    for so in KINDS:
        out = llm.generate([repeat], _params(so, max_tokens=40))[0].outputs[0]
        _check(so, out.text, out.finish_reason)
    assert stats.num_drafts == 0
    llm.generate([repeat], _params(None, max_tokens=40, ignore_eos=True))
    assert stats.num_drafts > 0
