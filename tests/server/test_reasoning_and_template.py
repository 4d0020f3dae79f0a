"""A server started with a chat template file (JAXLLM_CHAT_TEMPLATE: the bundled Hermes tools template) and a
reasoning parser (JAXLLM_REASONING_PARSER=qwen3), on the embedded SmolLM2: tools are rendered into the prompt,
<think> blocks go to reasoning_content, streamed and not, beside tool calls."""

import json
from pathlib import Path

import openai
import pytest

from tests.server.conftest import API_KEY, Server
from tests.server.test_tools import ASK, TOOLS, assemble

pytestmark = pytest.mark.slow
TEMPLATE = Path(__file__).resolve().parents[2] / "jaxllm/configs/templates/hermes_tools.jinja"


@pytest.fixture(scope="module")
def thinking_client(tmp_path_factory, compile_cache_dir):
    from tests.server.conftest import ENGINE_ENV

    env = {"JAXLLM_API_KEY": API_KEY, "JAXLLM_CHAT_TEMPLATE": str(TEMPLATE), "JAXLLM_REASONING_PARSER": "qwen3",
           "JAXLLM_COMPILATION_CACHE_DIR": compile_cache_dir}
    srv = Server(env, tmp_path_factory.mktemp("thinking") / "gunicorn.log", engine_env=ENGINE_ENV)
    yield openai.OpenAI(base_url=srv.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)
    srv.stop()


def test_the_template_file_renders_the_tools(thinking_client):
    name = thinking_client.models.list().data[0].id
    with_tools = thinking_client.chat.completions.create(model=name, messages=ASK, tools=TOOLS, max_tokens=1)
    without = thinking_client.chat.completions.create(model=name, messages=ASK, max_tokens=1)
    assert with_tools.usage.prompt_tokens > without.usage.prompt_tokens + 50  # the <tools> block is in the prompt
    none = thinking_client.chat.completions.create(model=name, messages=ASK, tools=TOOLS, tool_choice="none",
                                                   max_tokens=1)
    assert none.usage.prompt_tokens == without.usage.prompt_tokens  # "none": tools are not rendered


def test_think_blocks_go_to_reasoning_content_streamed_and_not(thinking_client):
    name = thinking_client.models.list().data[0].id
    body = dict(model=name, messages=ASK, temperature=1.0, seed=5, max_tokens=60,
                extra_body={"structured_outputs": {"regex": r"<think>\n[a-z ]{5,30}\n</think>\n\n(Sunny|Rainy)\."}})
    msg = thinking_client.chat.completions.create(**body).choices[0].message
    reasoning = msg.model_extra["reasoning_content"]
    assert 5 <= len(reasoning.strip()) <= 30 and msg.content in ("Sunny.", "Rainy.")
    streamed_reasoning, content = "", ""
    for chunk in thinking_client.chat.completions.create(**body, stream=True):
        for c in chunk.choices:
            streamed_reasoning += (c.delta.model_extra or {}).get("reasoning_content") or ""
            content += c.delta.content or ""
    assert (streamed_reasoning, content) == (reasoning, msg.content)


def test_reasoning_then_a_tool_call(thinking_client):
    name = thinking_client.models.list().data[0].id
    regex = (r'<think>\nthe user wants weather\n</think>\n\n<tool_call>\n\{"name": "get_weather", "arguments": '
             r'\{"city": "Paris", "unit": "celsius"\}\}\n</tool_call>')
    body = dict(model=name, messages=ASK, tools=TOOLS, max_tokens=80,
                extra_body={"structured_outputs": {"regex": regex}})
    c = thinking_client.chat.completions.create(**body).choices[0]
    assert c.message.model_extra["reasoning_content"] == "the user wants weather\n"
    assert c.finish_reason == "tool_calls" and c.message.content is None
    (call,) = c.message.tool_calls
    assert json.loads(call.function.arguments) == {"city": "Paris", "unit": "celsius"}
    content, calls, finish = assemble(thinking_client.chat.completions.create(**body, stream=True))
    assert (content, calls, finish) == ("", [("get_weather", call.function.arguments)], "tool_calls")
