"""Real clients against a live `tandem serve` of SmolLM2 (with an API key), whole and streamed:
the openai client's tools (tool_choice "auto": the generic format, SmolLM2's template knowing no
tools, calls a tool and then answers with its result; a family parser, Hermes from a
Hermes-style chat template, reads the calls the model writes in its own format), and the
anthropic client's Messages API (text, stop sequences, tool use, count_tokens, x-api-key), and
the openai client's Responses API (text, typed stream events, function tools over
previous_response_id, structured output, a stored response readable by its own key only), and
an openai-agents agent loop calling a function tool and answering with its result."""

from __future__ import annotations

import json

import anthropic
import openai
import pytest
from server_fixture import running_server

from tandem.config import EngineConfig
from tandem.server.api_server import ServerConfig

pytestmark = pytest.mark.slow
MODEL = "smollm2-135m"
KEY, OTHER_KEY = "sk-test", "sk-other"
CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city",
        "parameters": CITY,
    },
}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
HERMES_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nYou may call functions: <tools>{% for t in tools %}"
    '{{ t | tojson }}{% endfor %}</tools>\nFor each call, return <tool_call>\n{"name": <name>, '
    '"arguments": <arguments>}\n</tool_call><|im_end|>\n{% endif %}'
    "{%- for m in messages %}{%- if m.role == 'tool' %}<|im_start|>user\n<tool_response>\n"
    "{{ m.content }}\n</tool_response><|im_end|>\n{% elif m.tool_calls %}<|im_start|>assistant\n"
    '{% for c in m.tool_calls %}<tool_call>\n{"name": "{{ c.function.name }}", "arguments": '
    "{{ c.function.arguments | tojson }}}\n</tool_call>{% endfor %}<|im_end|>\n{% else %}"
    "<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def serve(**engine):
    config = EngineConfig.from_kwargs(
        model=MODEL, kv_cache_memory=64 << 20, max_model_len=2048, **engine
    )
    server = ServerConfig(model_name=MODEL, api_key=KEY, api_key_classes={OTHER_KEY: "standard"})
    with running_server(config, server) as (url, _):
        yield url


@pytest.fixture(scope="module")
def url():
    yield from serve()


@pytest.fixture(scope="module")
def generic(url):
    return openai.OpenAI(base_url=url + "/v1", api_key=KEY)


@pytest.fixture(scope="module")
def claude(url):
    return anthropic.Anthropic(base_url=url, api_key=KEY)


@pytest.fixture(scope="module")
def hermes():
    for url in serve(chat_template=HERMES_TEMPLATE):
        yield openai.OpenAI(base_url=url + "/v1", api_key=KEY)


def ask(client: openai.OpenAI, stream: bool, **body):
    """The assistant's message (content, tool_calls) and finish_reason, whole or streamed."""
    body = {"model": MODEL, "tools": [WEATHER], "temperature": 0, "max_tokens": 60, **body}
    if not stream:
        choice = client.chat.completions.create(**body).choices[0]
        return choice.message, choice.finish_reason
    with client.chat.completions.stream(**body) as events:
        choice = events.get_final_completion().choices[0]
    return choice.message, choice.finish_reason


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_generic_calls_then_answers_with_the_result(generic, stream):
    message, finish = ask(generic, stream, messages=ASK, tool_choice="required")
    assert finish == "tool_calls" and message.content in (None, "")
    call = message.tool_calls[0]
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    turn = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 21 C"},
    ]
    answer, finish = ask(generic, stream, messages=turn)  # tool_choice auto
    assert finish == "stop" and not answer.tool_calls and "Sunny" in answer.content


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_generic_answers_without_a_call(generic, stream):
    message, finish = ask(generic, stream, messages=[{"role": "user", "content": "Say hello."}])
    assert finish == "stop" and not message.tool_calls and message.content.strip()


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_hermes_family_calls_in_its_own_format(hermes, stream):
    message, finish = ask(
        hermes, stream, messages=ASK, tool_choice="required", parallel_tool_calls=False
    )
    assert finish == "tool_calls" and len(message.tool_calls) == 1
    call = message.tool_calls[0]
    assert call.function.name == "get_weather" and "city" in json.loads(call.function.arguments)
    turn = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 21 C"},
    ]
    answer, finish = ask(hermes, stream, messages=turn, max_tokens=20)
    assert finish == "stop" and not answer.tool_calls and "Sunny" in answer.content


CLAUDE_TOOL = {
    "name": "get_weather",
    "description": "The current weather in a city",
    "input_schema": CITY,
}


def claude_ask(client: anthropic.Anthropic, stream: bool, **body):
    # temperature: not among the SDK's typed fields any more; clients send it in the body
    body = {"model": MODEL, "max_tokens": 40, "extra_body": {"temperature": 0}, **body}
    if not stream:
        return client.messages.create(**body)
    with client.messages.stream(**body) as events:
        return events.get_final_message()


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_anthropic_text_stop_sequences_and_usage(claude, stream):
    say = [{"role": "user", "content": "Count from one to ten in words."}]
    whole = claude_ask(claude, False, messages=say, system="You are terse.")
    assert whole.content[0].type == "text" and whole.stop_reason in ("end_turn", "max_tokens")
    assert (
        whole.usage.input_tokens
        == claude.messages.count_tokens(
            model=MODEL, messages=say, system="You are terse."
        ).input_tokens
    )
    message = claude_ask(claude, stream, messages=say, system="You are terse.")
    assert message.content[0].text == whole.content[0].text
    word = whole.content[0].text.split()[1]
    cut = claude_ask(claude, stream, messages=say, system="You are terse.", stop_sequences=[word])
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == word
    assert word not in cut.content[0].text


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_anthropic_tool_use_round_trip(claude, stream):
    ask_ = [{"role": "user", "content": "What is the weather in Paris?"}]
    called = claude_ask(
        claude,
        stream,
        messages=ask_,
        tools=[CLAUDE_TOOL],
        max_tokens=60,
        tool_choice={"type": "any", "disable_parallel_tool_use": True},
    )
    assert called.stop_reason == "tool_use"
    use = next(b for b in called.content if b.type == "tool_use")
    assert use.name == "get_weather" and use.input == {"city": "Paris"}
    turn = ask_ + [
        {"role": "assistant", "content": called.content},
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "Sunny, 21 C"}],
        },
    ]
    answer = claude_ask(claude, stream, messages=turn, tools=[CLAUDE_TOOL])
    assert answer.stop_reason == "end_turn" and "Sunny" in answer.content[0].text


def test_anthropic_errors_and_keys(url):
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=url, api_key="wrong").messages.create(
            model=MODEL, max_tokens=4, messages=[{"role": "user", "content": "hi"}]
        )
    with pytest.raises(anthropic.BadRequestError, match="image"):
        anthropic.Anthropic(base_url=url, api_key=KEY).messages.create(
            model=MODEL,
            max_tokens=4,
            messages=[
                {
                    "role": "user",
                    "content": [{"type": "image", "source": {"type": "url", "url": "http://x"}}],
                }
            ],
        )


def test_responses_text_and_its_typed_stream(generic):
    body = dict(
        model=MODEL,
        instructions="You are terse.",
        input="Name a colour.",
        temperature=0,
        max_output_tokens=20,
    )
    whole = generic.responses.create(**body)
    assert whole.status in ("completed", "incomplete") and whole.output_text
    assert whole.usage.input_tokens > 5 and whole.usage.output_tokens > 0
    events = list(generic.responses.create(**body, stream=True))
    names = [e.type for e in events]
    assert names[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert names[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        f"response.{whole.status}",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == whole.output_text == events[-1].response.output_text


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_responses_function_call_over_previous_response_id(generic, stream):
    tool = {"type": "function", **WEATHER["function"]}
    body = dict(
        model=MODEL,
        input="What is the weather in Paris?",
        tools=[tool],
        temperature=0,
        tool_choice="required",
        parallel_tool_calls=False,
        max_output_tokens=60,
    )
    if stream:
        with generic.responses.stream(**body) as events:
            first = events.get_final_response()
    else:
        first = generic.responses.create(**body)
    call = next(i for i in first.output if i.type == "function_call")
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"}
    answer = generic.responses.create(
        model=MODEL,
        previous_response_id=first.id,
        tools=[tool],
        temperature=0,
        max_output_tokens=30,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 21 C"}],
    )
    assert "Sunny" in answer.output_text


def test_responses_structured_output_store_and_keys(url, generic):
    schema = {
        "type": "object",
        "properties": {"colour": {"enum": ["red", "blue"]}},
        "required": ["colour"],
        "additionalProperties": False,
    }
    fmt = {"type": "json_schema", "name": "c", "schema": schema}
    made = generic.responses.create(
        model=MODEL, input="Pick a colour.", temperature=0, text={"format": fmt}
    )
    assert json.loads(made.output_text)["colour"] in ("red", "blue")
    assert generic.responses.retrieve(made.id).id == made.id
    other = openai.OpenAI(base_url=url + "/v1", api_key=OTHER_KEY)
    with pytest.raises(openai.NotFoundError):
        other.responses.retrieve(made.id)
    with pytest.raises(openai.NotFoundError):
        other.responses.create(
            model=MODEL, input="and?", previous_response_id=made.id, max_output_tokens=2
        )
    unkept = generic.responses.create(model=MODEL, input="hi", store=False, max_output_tokens=2)
    assert unkept.status == "incomplete" and unkept.incomplete_details.reason == "max_output_tokens"
    with pytest.raises(openai.NotFoundError):
        generic.responses.retrieve(unkept.id)
    generic.responses.delete(made.id)
    with pytest.raises(openai.NotFoundError):
        generic.responses.retrieve(made.id)


@pytest.mark.parametrize("api", ["chat_completions", "responses"])
def test_openai_agents_loop_calls_a_tool_and_answers_with_its_result(url, api):
    agents = pytest.importorskip("agents")
    agents.set_tracing_disabled(True)
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key=KEY)
    model = (
        agents.OpenAIChatCompletionsModel
        if api == "chat_completions"
        else agents.OpenAIResponsesModel
    )(model=MODEL, openai_client=client)
    calls = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        calls.append(city)
        return "Sunny, 21 C"

    settings = agents.ModelSettings(
        tool_choice="required", parallel_tool_calls=False, temperature=0, max_tokens=60
    )
    agent = agents.Agent(
        name="weather",
        instructions="Answer questions about the weather.",
        model=model,
        tools=[get_weather],
        model_settings=settings,
    )
    result = agents.Runner.run_sync(agent, "What is the weather in Paris?", max_turns=3)
    assert calls == ["Paris"] and "Sunny" in result.final_output
