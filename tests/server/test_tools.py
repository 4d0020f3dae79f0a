"""Tool calling over HTTP with the `openai` client against real gunicorn on SmolLM2 (whose template renders no
tools: named and required choices still constrain the answer, as vLLM serves them)."""

import json

import jsonschema
import pytest

from tests.server.conftest import serve_mode_fixtures

server, client = serve_mode_fixtures()  # each test in both serve modes

pytestmark = pytest.mark.slow

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "minLength": 1, "maxLength": 20},
                                            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET", "PST"]}},
        "required": ["zone"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "description": "Time in a zone", "parameters": TIME}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def model_name(client):
    return client.models.list().data[0].id


def assemble(stream):
    """Streamed chunks -> (content, [(name, arguments)], finish_reason)."""
    content, calls, finish = "", {}, None
    for chunk in stream:
        for choice in chunk.choices:
            delta = choice.delta
            content += delta.content or ""
            for tc in delta.tool_calls or ():
                entry = calls.setdefault(tc.index, {"name": None, "arguments": "", "id": None})
                if tc.id:
                    assert entry["id"] is None and tc.function.name  # id and name come first, once
                    entry["id"], entry["name"] = tc.id, tc.function.name
                entry["arguments"] += tc.function.arguments or ""
            finish = choice.finish_reason or finish
    return content, [(c["name"], c["arguments"]) for _, c in sorted(calls.items())], finish


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
def test_required_and_named_choices_give_valid_calls_streamed_and_not(client, model_name, choice):
    for seed in range(3):
        done = client.chat.completions.create(model=model_name, messages=ASK, tools=TOOLS, tool_choice=choice,
                                              temperature=1.0, seed=seed, max_tokens=120)
        c = done.choices[0]
        assert c.finish_reason == "tool_calls" and c.message.content is None and c.message.tool_calls
        for call in c.message.tool_calls:
            assert call.type == "function" and call.id.startswith("call_")
            jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
        if choice != "required":
            assert [call.function.name for call in c.message.tool_calls] == ["get_time"]
        stream = client.chat.completions.create(model=model_name, messages=ASK, tools=TOOLS, tool_choice=choice,
                                                temperature=1.0, seed=seed, max_tokens=120, stream=True)
        content, calls, finish = assemble(stream)
        assert finish == "tool_calls" and not content
        assert calls == [(t.function.name, t.function.arguments) for t in c.message.tool_calls]


def test_parallel_tool_calls_false_gives_one_call(client, model_name):
    for seed in range(3):
        done = client.chat.completions.create(model=model_name, messages=ASK, tools=TOOLS, tool_choice="required",
                                              parallel_tool_calls=False, temperature=1.0, seed=seed, max_tokens=120)
        assert len(done.choices[0].message.tool_calls) == 1


def test_auto_parses_hermes_calls_from_text_streamed_and_not(client, model_name):
    # SmolLM2 never writes <tool_call> blocks by itself: a regex makes it write one, the hermes parser reads it
    regex = r'I will check\.\n<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "[A-Z][a-z]{2,8}", ' \
            r'"unit": "celsius"\}\}\n</tool_call>'
    body = dict(model=model_name, messages=ASK, tools=TOOLS, temperature=1.0, seed=4, max_tokens=80,
                extra_body={"structured_outputs": {"regex": regex}})
    c = client.chat.completions.create(**body).choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content == "I will check.\n"
    (call,) = c.message.tool_calls
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER)
    content, calls, finish = assemble(client.chat.completions.create(**body, stream=True))
    assert (content, calls, finish) == ("I will check.\n", [("get_weather", call.function.arguments)], "tool_calls")
    plain = client.chat.completions.create(model=model_name, messages=ASK, tools=TOOLS, temperature=0,
                                           max_tokens=20).choices[0]
    assert plain.message.tool_calls is None and plain.message.content and plain.finish_reason != "tool_calls"


def test_a_conversation_continues_after_a_tool_message(client, model_name):
    first = client.chat.completions.create(model=model_name, messages=ASK, tools=TOOLS,
                                           tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                           temperature=0, max_tokens=60).choices[0].message
    history = ASK + [first.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": first.tool_calls[0].id, "content": '{"temperature": 21}'}]
    reply = client.chat.completions.create(model=model_name, messages=history, tools=TOOLS, tool_choice="none",
                                           temperature=0, max_tokens=30).choices[0]
    assert reply.message.content and reply.message.tool_calls is None
