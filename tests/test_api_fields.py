"""Request fields at the route (a fake engine that records what it is asked): every hint is
accepted on each endpoint that declares it, a refused field is a 400 naming it and why, each
implemented field reaches the engine as it should, and docs/api_fields.md is the table the
request models give. What needs a model (logprobs, echo, best_of, ...) is in
test_api_fields_server.py."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_server_routes import client_for, word_tokenizer

from tandem.server import api_fields
from tandem.server.routes import chat, completions

HI = [{"role": "user", "content": "hi"}]
CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
HINTS = {
    "user": "u",
    "metadata": {"a": "b"},
    "store": False,
    "service_tier": "auto",
    "safety_identifier": "s",
    "prompt_cache_key": "k",
    "spaces_between_special_tokens": False,
    "guided_decoding_backend": "xgrammar",
    "stream_options": {"include_obfuscation": False},
    "modalities": ["text"],
    "verbosity": "low",
}
CHAT_ONLY = ("modalities", "verbosity")
NESTED_HINTS = (
    "stream_options.include_obfuscation",
    "chat_template_kwargs.*",
    "tools[].function.strict",
    "response_format.json_schema.strict",
)


def post(path: str, **body):
    """(response, (prompt ids, SamplingParams) the engine got) of a request to a route alone."""
    client, state = client_for(chat.router if path == CHAT else completions.router)
    body.setdefault("messages" if path == CHAT else "prompt", HI if path == CHAT else "hi")
    r = client.post(path, json=body)
    return r, state.llm.requests[-1] if state.llm.requests else None


def test_the_docs_table_is_current():
    text = (Path(__file__).resolve().parents[1] / "docs" / "api_fields.md").read_text()
    assert text == api_fields.table(), "python -m tandem.server.api_fields > docs/api_fields.md"


def test_the_hints_are_the_ones_listed_here():
    rows = [row for model in api_fields.OPENAI.values() for row in api_fields._rows(model)]
    hints = {name for name, status, _ in rows if status == "hint"}
    assert hints == {*HINTS, *NESTED_HINTS} - {"stream_options"}


@pytest.mark.parametrize("name", sorted(HINTS))
def test_hints_are_accepted_and_change_nothing(name):
    for path in (CHAT, COMPLETIONS):
        if name in CHAT_ONLY and path == COMPLETIONS:
            continue
        _, plain = post(path, max_tokens=3)
        r, asked = post(path, max_tokens=3, **{name: HINTS[name]})
        assert r.status_code == 200, r.text
        assert asked == plain


@pytest.mark.parametrize(
    "path,body",
    [
        (COMPLETIONS, {"suffix": "x"}),
        (CHAT, {"echo": True}),
        (CHAT, {"modalities": ["audio"]}),
        (COMPLETIONS, {"not_a_field": 1}),
    ],
)
def test_what_would_change_the_output_and_is_not_implemented_is_a_400_naming_it(path, body):
    r, _ = post(path, **body)
    assert r.status_code == 400 and list(body)[0] in r.json()["error"]["param"], r.text


def test_sampling_fields_reach_the_engine():
    r, (_, params) = post(
        CHAT,
        logit_bias={"7": 5, "8": -100},
        max_completion_tokens=4,
        top_k=3,
        min_p=0.1,
        repetition_penalty=1.1,
        min_tokens=1,
        ignore_eos=True,
        stop_token_ids=[6],
        include_stop_str_in_output=True,
        skip_special_tokens=False,
        prompt_logprobs=2,
    )
    assert r.status_code == 200, r.text
    assert params.logit_bias == {7: 5.0, 8: -100.0} and params.prompt_logprobs == 2
    assert (params.max_tokens, params.top_k, params.min_p) == (4, 3, 0.1)
    assert (params.repetition_penalty, params.min_tokens, params.stop_token_ids) == (1.1, 1, [6])
    assert params.ignore_eos and params.include_stop_str_in_output
    assert not params.skip_special_tokens
    for bias, words in [({"x": 1}, "token ids"), ({"7": 101}, "less than or equal to 100")]:
        r, _ = post(CHAT, logit_bias=bias)
        assert r.status_code == 400 and words in r.json()["error"]["message"], r.text


@pytest.mark.parametrize(
    "body,param",
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"n": 3, "best_of": 2}, "best_of"),
        ({"best_of": 2, "stream": True}, "best_of"),
        ({"prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
        ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
        ({"truncate_prompt_tokens": -2}, "truncate_prompt_tokens"),
    ],
)
def test_completions_combinations_that_cannot_be_served_are_400s(body, param):
    r, _ = post(COMPLETIONS, **body)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_truncate_prompt_tokens_keeps_the_last_tokens():
    assert post(COMPLETIONS, prompt=[6, 7, 8, 9], truncate_prompt_tokens=2)[1][0] == [8, 9]
    assert post(COMPLETIONS, prompt=[6, 7], truncate_prompt_tokens=-1)[1][0] == [6, 7]
    # "user: hi\nassistant:" ends in "assistant", ":"
    assert post(CHAT, truncate_prompt_tokens=2)[1][0] == word_tokenizer().encode("assistant:")


def test_add_special_tokens():
    from tokenizers import processors

    client, state = client_for(completions.router)
    tok = word_tokenizer()  # with a "BOS" for the test: id 3 first
    tok.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="tools $A", special_tokens=[("tools", 3)]
    )
    state.facts.tokenizer = tok
    state.facts.tokenize = lambda p: tok.encode(p) if isinstance(p, str) else list(p)
    client.post(COMPLETIONS, json={"prompt": "hi there"})
    assert state.llm.requests[-1][0] == [3, 6, 7]
    client.post(COMPLETIONS, json={"prompt": "hi there", "add_special_tokens": False})
    assert state.llm.requests[-1][0] == [6, 7]


def test_continue_final_message_and_chat_template_kwargs():
    turn = HI + [{"role": "assistant", "content": "hi there"}]
    r, (ids, _) = post(
        CHAT, messages=turn, continue_final_message=True, add_generation_prompt=False
    )
    assert r.status_code == 200 and ids == word_tokenizer().encode("user: hi\nassistant: hi there")
    both, _ = post(CHAT, messages=turn, continue_final_message=True)
    assert both.status_code == 400
    assert "add_generation_prompt false" in both.json()["error"]["message"]
    r, (ids, _) = post(CHAT, chat_template_kwargs={"unread": 1})
    assert r.status_code == 200 and ids == word_tokenizer().encode("user: hi\nassistant:")


@pytest.mark.parametrize(
    "effort,shown", [("high", "style: True"), ("none", "style: False"), (None, "")]
)
def test_reasoning_effort_is_the_templates_thinking_switch(effort, shown):
    client, state = client_for(chat.router)
    tok = word_tokenizer()
    tok.chat_template = (
        "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"
        "{% if enable_thinking is defined %}style: {{ enable_thinking }}"
        "{% endif %}"
    )
    state.facts.tokenizer = tok
    r = client.post(CHAT, json={"messages": HI, "reasoning_effort": effort})
    assert r.status_code == 200, r.text
    assert state.llm.requests[-1][0] == word_tokenizer().encode(f"hi\n{shown}")
