"""tool_choice "auto" through a live `tandem serve` of SmolLM2 with the official openai client,
whole and streamed: the generic format (SmolLM2's template knows no tools) calls a tool and then
answers with its result, and a family parser (Hermes, from a Hermes-style chat template) reads
the calls the model writes in its own format."""
from __future__ import annotations

import json

import openai
import pytest

from server_fixture import running_server
from tandem.config import EngineConfig
from tandem.server.api_server import ServerConfig

pytestmark = pytest.mark.slow
MODEL = "smollm2-135m"
CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city", "parameters": CITY}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
HERMES_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nYou may call functions: <tools>{% for t in tools %}"
    "{{ t | tojson }}{% endfor %}</tools>\nFor each call, return <tool_call>\n{\"name\": <name>, "
    "\"arguments\": <arguments>}\n</tool_call><|im_end|>\n{% endif %}"
    "{%- for m in messages %}{%- if m.role == 'tool' %}<|im_start|>user\n<tool_response>\n"
    "{{ m.content }}\n</tool_response><|im_end|>\n{% elif m.tool_calls %}<|im_start|>assistant\n"
    "{% for c in m.tool_calls %}<tool_call>\n{\"name\": \"{{ c.function.name }}\", \"arguments\": "
    "{{ c.function.arguments | tojson }}}\n</tool_call>{% endfor %}<|im_end|>\n{% else %}"
    "<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def serve(**engine):
    config = EngineConfig(model=MODEL, kv_cache_memory=64 << 20, max_model_len=2048, **engine)
    with running_server(config, ServerConfig(model_name=MODEL)) as (url, _):
        yield openai.OpenAI(base_url=url + "/v1", api_key="unused")


@pytest.fixture(scope="module")
def generic():
    yield from serve()


@pytest.fixture(scope="module")
def hermes():
    yield from serve(chat_template=HERMES_TEMPLATE)


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
    turn = ASK + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                  {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 21 C"}]
    answer, finish = ask(generic, stream, messages=turn)  # tool_choice auto
    assert finish == "stop" and not answer.tool_calls and "Sunny" in answer.content


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_generic_answers_without_a_call(generic, stream):
    message, finish = ask(generic, stream, messages=[{"role": "user", "content": "Say hello."}])
    assert finish == "stop" and not message.tool_calls and message.content.strip()


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_hermes_family_calls_in_its_own_format(hermes, stream):
    message, finish = ask(hermes, stream, messages=ASK, tool_choice="required",
                          parallel_tool_calls=False)
    assert finish == "tool_calls" and len(message.tool_calls) == 1
    call = message.tool_calls[0]
    assert call.function.name == "get_weather" and "city" in json.loads(call.function.arguments)
    turn = ASK + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                  {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 21 C"}]
    answer, finish = ask(hermes, stream, messages=turn, max_tokens=20)
    assert finish in ("stop", "length", "tool_calls")
    assert answer.content or answer.tool_calls
