"""Structured outputs over HTTP with the official `openai` client against real gunicorn: `parse` with pydantic
models (streamed and not), json_object, and vLLM's `structured_outputs` on both routes."""

import json
import re

import jsonschema
import pytest

from benchmarks.structured_cases import MODELS, PROMPTS
from tests.server.conftest import serve_mode_fixtures

server, client = serve_mode_fixtures()  # each test in both serve modes

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def model_name(client):
    return client.models.list().data[0].id


@pytest.mark.parametrize("index", range(len(MODELS)))
def test_parse_returns_a_validated_object_streamed_and_not(client, model_name, index):
    model, prompt = MODELS[index], PROMPTS[index]
    messages = [{"role": "user", "content": f"{prompt} Answer in JSON."}]
    done = client.chat.completions.parse(model=model_name, messages=messages, response_format=model,
                                         temperature=1.0, seed=index, max_tokens=300)
    parsed = done.choices[0].message.parsed
    assert isinstance(parsed, model) and done.choices[0].finish_reason == "stop"
    with client.chat.completions.stream(model=model_name, messages=messages, response_format=model,
                                        temperature=1.0, seed=index, max_tokens=300) as stream:
        final = stream.get_final_completion()
    assert isinstance(final.choices[0].message.parsed, model)
    assert final.choices[0].message.content == done.choices[0].message.content  # same seed, same tokens


def test_json_object_and_regex_and_choice_on_both_routes(client, model_name):
    chat = client.chat.completions.create(
        model=model_name, messages=[{"role": "user", "content": "Give a JSON object with a name and an age."}],
        response_format={"type": "json_object"}, temperature=0, max_tokens=200,
        extra_body={"repetition_penalty": 1.3})
    if chat.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(chat.choices[0].message.content), dict)
    else:
        assert chat.choices[0].message.content.startswith("{")
    regex = r"[0-9]{3}-[0-9]{4}"
    comp = client.completions.create(model=model_name, prompt="Call me at", max_tokens=30, temperature=1.0, n=4,
                                     seed=1, extra_body={"structured_outputs": {"regex": regex}})
    assert all(re.fullmatch(regex, c.text) and c.finish_reason == "stop" for c in comp.choices)
    schema = MODELS[0].model_json_schema()
    comp = client.completions.create(model=model_name, prompt="A city as JSON:", max_tokens=200, temperature=1.0,
                                     seed=2, extra_body={"response_format": {
                                         "type": "json_schema", "json_schema": {"name": "city", "schema": schema}}})
    jsonschema.validate(json.loads(comp.choices[0].text), schema)
    stream = client.chat.completions.create(
        model=model_name, messages=[{"role": "user", "content": "Yes or no?"}], stream=True, max_tokens=10,
        extra_body={"structured_outputs": {"choice": ["yes", "no", "perhaps"]}})
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) in ("yes", "no", "perhaps")
