"""Tool call parsers: whole answers, and streams (the text growing character by character) that assemble to
exactly the whole answer; a call that does not parse stays content."""

import json

import pytest

from jaxllm.tools.parsers import TOOL_PARSERS, parser_for_template, tool_parser

CALL = {"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}
CASES = [
    ("hermes", 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n'
               '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>',
     "Let me check.\n", [("get_weather", CALL["arguments"]), ("get_time", {})]),
    ("hermes", "No tools needed: 4 < 5 and <b>bold</b>.", "No tools needed: 4 < 5 and <b>bold</b>.", []),
    ("hermes", 'Oops <tool_call>{"name": broken}</tool_call>', 'Oops <tool_call>{"name": broken}</tool_call>', []),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris", "days": 2}}; '
                    '{"name": "get_time", "parameters": {}}', "", [("get_weather", CALL["arguments"]),
                                                                   ("get_time", {})]),
    ("llama3_json", "The weather is fine.", "The weather is fine.", []),
    ("mistral", 'Sure [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}]', "Sure ",
     [("get_weather", CALL["arguments"])]),
    ("mistral", "Plain [TOOL answer", "Plain [TOOL answer", []),
]


@pytest.mark.parametrize(("name", "text", "content", "calls"), CASES)
def test_whole_answers(name, text, content, calls):
    scan = tool_parser(name).scan(text, True)
    assert scan.content == content
    assert [(c.name, json.loads(c.arguments)) for c in scan.calls] == calls


@pytest.mark.parametrize(("name", "text", "content", "calls"), CASES)
def test_streams_assemble_to_the_whole_answer(name, text, content, calls):
    parser = tool_parser(name)
    sent, seen_calls = "", []
    for end in range(1, len(text) + 1):
        scan = parser.scan(text[:end], end == len(text))
        assert scan.content.startswith(sent)  # content only grows: nothing sent is taken back
        assert "<tool_call" not in scan.content[len(sent):] or not calls  # no partial tag leaks into content
        sent = scan.content
        assert [c.name for c in scan.calls[:len(seen_calls)]] == seen_calls
        seen_calls = [c.name for c in scan.calls]
    assert sent == content and seen_calls == [c for c, _ in calls]


def test_the_parser_follows_the_template():
    assert parser_for_template("{{ '<tool_call>' }}") == "hermes"
    assert parser_for_template("[TOOL_CALLS] {{ x }}") == "mistral"
    assert parser_for_template("<|python_tag|>") == "llama3_json"
    assert parser_for_template(None) == "hermes" and set(TOOL_PARSERS) == {"hermes", "llama3_json", "mistral"}
    with pytest.raises(ValueError, match="unknown tool call parser"):
        tool_parser("nope")
