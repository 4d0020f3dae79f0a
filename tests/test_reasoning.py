"""Reasoning parsers: whole answers and streams that assemble to them."""

import pytest

from jaxllm.reasoning import reasoning_parser

CASES = [
    ("qwen3", "<think>\nThe user greets me.\n</think>\n\nHello!", "The user greets me.\n", "Hello!"),
    ("qwen3", "Hello without thinking.", "", "Hello without thinking."),
    ("qwen3", "<think>\nstill thinking when cut", "still thinking when cut", ""),
    ("qwen3", "<thinking is not the tag", "", "<thinking is not the tag"),
    ("deepseek_r1", "Let me see, 2+2=4.\n</think>\n\nThe answer is 4.", "Let me see, 2+2=4.\n",
     "The answer is 4."),
    ("deepseek_r1", "<think>Short.</think>Done", "Short.", "Done"),
]


@pytest.mark.parametrize(("name", "text", "reasoning", "content"), CASES)
def test_whole_and_streamed(name, text, reasoning, content):
    parser = reasoning_parser(name)
    whole = parser.split(text, True)
    assert (whole.reasoning, whole.content) == (reasoning, content)
    sent_r = sent_c = ""
    for end in range(1, len(text) + 1):
        part = parser.split(text[:end], end == len(text))
        assert part.reasoning.startswith(sent_r) and part.content.startswith(sent_c), (text[:end], part)
        assert "</think" not in part.reasoning and (content.startswith("<think") or "<think>" not in part.content)
        sent_r, sent_c = part.reasoning, part.content
    assert (sent_r, sent_c) == (reasoning, content)


def test_unknown_parser():
    with pytest.raises(ValueError, match="unknown reasoning parser"):
        reasoning_parser("nope")
