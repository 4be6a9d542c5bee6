"""Tool-call parsers on their families' documented output formats (Hermes / Qwen, Llama 3.x
JSON, Mistral v3 and v11, the generic JSON), whole and streamed a character at a time: the
stream sends the same text and calls as the whole, never takes text back, and an output cut
off or malformed is plain text, never an exception. The constraints they build compile and
accept their own format."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tandem.server.tool_parsers import FAMILIES, tool_parser
from tandem.server.tool_parsers.generic import GenericToolParser, calls_as_text

WEATHER = ("get_weather", {"location": "San Francisco, CA", "unit": "celsius"})
DATE = ("get_date", {"tz": "UTC"})
W_ARGS = '{"location": "San Francisco, CA", "unit": "celsius"}'
CASES = {  # parser: [(output, content, calls)]
    "hermes": [
        (
            '<tool_call>\n{"name": "get_weather", "arguments": ' + W_ARGS + "}\n</tool_call>\n"
            '<tool_call>\n{"name": "get_date", "arguments": {"tz": "UTC"}}\n</tool_call>',
            "",
            [WEATHER, DATE],
        ),
        (
            'Let me check. <tool_call>\n{"name": "get_date", "arguments": {"tz": "UTC"}}\n'
            "</tool_call>",
            "Let me check. ",
            [DATE],
        ),
        ("No tools needed: 2 < 3.", "No tools needed: 2 < 3.", []),
    ],
    "llama3_json": [
        ('{"name": "get_weather", "parameters": ' + W_ARGS + "}", "", [WEATHER]),
        (
            '<|python_tag|>{"name": "get_weather", "parameters": ' + W_ARGS + "}; "
            '{"name": "get_date", "parameters": {"tz": "UTC"}}',
            "",
            [WEATHER, DATE],
        ),
        ('It is {"cold": true}.', 'It is {"cold": true}.', []),
    ],
    "mistral": [
        (
            '[TOOL_CALLS][{"name": "get_weather", "arguments": ' + W_ARGS + "}, "
            '{"name": "get_date", "arguments": {"tz": "UTC"}}]',
            "",
            [WEATHER, DATE],
        ),
        (
            "[TOOL_CALLS]get_weather[ARGS]" + W_ARGS + '[TOOL_CALLS]get_date[ARGS]{"tz": "UTC"}',
            "",
            [WEATHER, DATE],
        ),
        ("Sunny [ish].", "Sunny [ish].", []),
    ],
    "generic": [
        (
            '{"tool_calls": [{"name": "get_weather", "arguments": ' + W_ARGS + "}, "
            '{"name": "get_date", "arguments": {"tz": "UTC"}}]}',
            "",
            [WEATHER, DATE],
        ),
        ('{"response": "Hi \\"there\\"\\n\\u00e9\\\\"}', 'Hi "there"\n\u00e9\\', []),
    ],
}
CUT_OR_MALFORMED = {
    "hermes": [
        '<tool_call>\n{"name": "get_weather", "argum',
        "<tool_call>\nnot json\n</tool_call>",
        '<tool_call>{"name": 3}</tool_call>',
    ],
    "llama3_json": [
        '{"name": "get_weather", "parameters": {"loc',
        '<|python_tag|>brave_search.call(q="x")',
        '{"name": 3, "parameters": {}}',
    ],
    "mistral": [
        '[TOOL_CALLS][{"name": "get_weather", "arguments": {',
        "[TOOL_CALLS]get_weather",
        '[TOOL_CALLS][{"nope": 1}]',
    ],
    "generic": ['{"tool_calls": [{"name": "get_weather", "argu', '{"tool_calls": []}', "plain"],
}
PIECES = [
    "<tool_call>",
    "</tool_call>",
    "[TOOL_CALLS]",
    "[ARGS]",
    "<|python_tag|>",
    '{"name": "f", ',
    '"arguments": {}}',
    '"parameters": ',
    "{",
    "}",
    "[",
    "]",
    '"',
    "\\",
    ";",
    "x",
    " ",
    '{"response": "',
    '{"tool_calls": [',
]


def parser(name: str):
    return GenericToolParser() if name == "generic" else FAMILIES[name]()


def streamed(p, text: str) -> tuple[str, list]:
    """The content and calls a stream sends, a character at a time; what it sent stays sent."""
    content, calls = "", []
    for i in range(1, len(text) + 1):
        got = p.extract(text[:i], final=i == len(text))
        assert got.content.startswith(content) and got.calls[: len(calls)] == calls, (text[:i], got)
        content, calls = got.content, got.calls
    return content, calls


@pytest.mark.parametrize(
    "name,text,content,calls", [(n, *case) for n, cases in CASES.items() for case in cases]
)
def test_documented_formats_whole_and_streamed(name, text, content, calls):
    p = parser(name)
    got = p.extract(text, final=True)
    assert (got.content, got.calls) == (content, calls)
    assert streamed(p, text) == (content, calls)


@pytest.mark.parametrize(
    "name,text", [(n, t) for n, texts in CUT_OR_MALFORMED.items() for t in texts]
)
def test_cut_off_or_malformed_calls_are_plain_text(name, text):
    p = parser(name)
    assert p.extract(text, final=True).calls == []
    assert p.extract(text, final=True).content == text
    assert streamed(p, text) == (text, [])


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from(PIECES), max_size=12))
def test_any_output_parses_without_an_exception_and_streams_monotonically(parts):
    text = "".join(parts)
    for name in CASES:
        streamed(parser(name), text)


def test_the_template_names_the_family():
    class Tok:
        def __init__(self, template):
            self.chat_template = template

    assert tool_parser(None, Tok("{{ '<tool_call>' }}")).name == "hermes"
    assert tool_parser(None, Tok("{{ '<|python_tag|>' }}")).name == "llama3_json"
    assert tool_parser(None, Tok("{{ '[TOOL_CALLS]' }}")).name == "mistral"
    generic = tool_parser(None, Tok("{% for m in messages %}{{ m.content }}{% endfor %}"))
    assert generic.name == "generic" and not generic.renders_tools and not generic.renders_calls
    assert tool_parser("hermes", Tok("")).name == "hermes"


def test_generic_prompt_describes_the_tools_and_tells_earlier_calls_in_words():
    tools = [{"type": "function", "function": {"name": "get_date", "parameters": {}}}]
    call = {"id": "c1", "type": "function", "function": {"name": "get_date", "arguments": {}}}
    messages = [
        {"role": "user", "content": "date?"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": "Monday", "tool_call_id": "c1"},
        {"role": "tool", "content": "UTC", "tool_call_id": "c2"},
    ]
    shown, rendered_tools = GenericToolParser().prompt(messages, tools, None)
    assert rendered_tools is None and shown[0]["role"] == "system"
    assert "get_date" in shown[0]["content"] and '{"response"' in shown[0]["content"]
    assert shown[2] == {"role": "assistant", "content": "I called get_date with {}."}
    # both results in one user turn
    results = "get_date returned: Monday\nThe tool returned: UTC"
    assert shown[3:] == [{"role": "user", "content": results}]
    assert calls_as_text(messages[:1]) == messages[:1]


@pytest.fixture(scope="module")
def compiler(tiny_model_dirs, tmp_path_factory):
    from structured_fixture import with_tokenizer

    from tandem.executor.grammar_compiler import GrammarCompiler
    from tandem.models.loader.model_files import load_tokenizer

    path = with_tokenizer(tiny_model_dirs["llama"], tmp_path_factory.mktemp("parsers") / "tiny")
    tok = load_tokenizer(path)
    return tok, GrammarCompiler(tok, 512, tok.eos_token_id)


CALL = {
    "hermes": '<tool_call>\n{{"name": "{}", "arguments": {{"tz": "UTC"}}}}\n</tool_call>',
    "llama3_json": '{{"name": "{}", "parameters": {{"tz": "UTC"}}}}',
    "generic": '{{"tool_calls": [{{"name": "{}", "arguments": {{"tz": "UTC"}}}}]}}',
}


@pytest.mark.parametrize("name", ["hermes", "llama3_json", "generic"])
@pytest.mark.parametrize("choice", [None, "required", "get_date"])
def test_constraints_accept_their_own_format_and_the_schema_only(compiler, name, choice):
    import xgrammar as xgr

    tok, grammars = compiler
    schema = {"type": "object", "properties": {"tz": {"enum": ["UTC", "CET"]}}, "required": ["tz"]}
    tools = [
        {"type": "function", "function": {"name": n, "parameters": schema}}
        for n in ("get_date", "f")
    ]
    grammar = grammars.get(parser(name).constraint(tools, choice, parallel=True))

    def accepts(text: str) -> bool:
        m = xgr.GrammarMatcher(grammar)
        return all(m.accept_token(t) for t in tok.encode(text))

    assert accepts(CALL[name].format("get_date"))
    assert accepts(CALL[name].format("f")) == (choice != "get_date")
    assert not accepts(CALL[name].format("get_date").replace("UTC", "PST"))
    free = choice is None and name != "generic"  # text, and calls after it
    assert accepts("Hello") == free and accepts("Hi. " + CALL[name].format("f")) == free
