"""`tool_choice: auto` end to end on tiny random models served with the hermes and the llama3_json parsers: a regex
makes the model write its family's call format, the server's parser reads the calls, streamed and not."""

import json

import openai
import pytest

from tests.server.conftest import API_KEY, Server, tiny_engine_env
from tests.server.test_tools import TOOLS, assemble

ASK = [{"role": "user", "content": "weather?"}]
FORMATS = {
    "hermes": (r'ok <tool_call>\{"name": "get_weather", "arguments": \{"city": "Oslo", "unit": "celsius"\}\}'
               r'</tool_call>', "ok "),
    "llama3_json": (r'\{"name": "get_time", "parameters": \{"zone": "UTC"\}\}; '
                    r'\{"name": "get_weather", "parameters": \{"city": "Rome", "unit": "fahrenheit"\}\}', ""),
}
CALLS = {"hermes": [("get_weather", {"city": "Oslo", "unit": "celsius"})],
         "llama3_json": [("get_time", {"zone": "UTC"}), ("get_weather", {"city": "Rome", "unit": "fahrenheit"})]}


@pytest.fixture(scope="module", params=sorted(FORMATS))
def tiny_tools_server(request, tmp_path_factory, tiny_folder, compile_cache_dir):
    env = {"JAXLLM_API_KEY": API_KEY, "JAXLLM_TOOL_CALL_PARSER": request.param}
    srv = Server(env, tmp_path_factory.mktemp(f"tiny_{request.param}") / "server.log",
                 engine_env=tiny_engine_env(tiny_folder, compile_cache_dir))
    yield request.param, openai.OpenAI(base_url=srv.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)
    srv.stop()


def test_auto_reads_the_family_format_streamed_and_not(tiny_tools_server):
    parser, client = tiny_tools_server
    regex, content = FORMATS[parser]
    name = client.models.list().data[0].id
    body = dict(model=name, messages=ASK, tools=TOOLS, tool_choice="auto", max_tokens=200, temperature=1.0, seed=0,
                extra_body={"structured_outputs": {"regex": regex}})
    c = client.chat.completions.create(**body).choices[0]
    assert c.finish_reason == "tool_calls" and (c.message.content or "") == content
    got = [(t.function.name, json.loads(t.function.arguments)) for t in c.message.tool_calls]
    assert got == CALLS[parser]
    streamed = assemble(client.chat.completions.create(**body, stream=True))
    assert streamed == (content, [(t.function.name, t.function.arguments) for t in c.message.tool_calls],
                        "tool_calls")
    plain = client.chat.completions.create(model=name, messages=ASK, tools=TOOLS, max_tokens=8, temperature=0)
    assert plain.choices[0].message.tool_calls is None  # random text is no call
