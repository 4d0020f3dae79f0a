"""Reasoning output: the ``<think>...</think>`` part of an answer goes to `reasoning_content`, the rest is the
answer's content.

- ``qwen3``: the model opens the block itself (``<think>`` first in its answer); with ``enable_thinking: false``
  the template writes an empty block into the prompt and the answer is all content;
- ``deepseek_r1``: the template opens the block in the prompt, so the answer is reasoning until ``</think>``.

`split` reads the text generated so far; while streaming, a possible partial tag at the end is held back, so
reasoning and content only ever grow and the deltas assemble to the non-streamed message.
"""

from __future__ import annotations

import dataclasses

from jaxllm.tools.parsers import held_back

START, END = "<think>", "</think>"


@dataclasses.dataclass(frozen=True)
class Split:
    reasoning: str
    content: str


@dataclasses.dataclass(frozen=True)
class ReasoningParser:
    name: str
    opened_by_prompt: bool  # deepseek_r1: the answer starts inside the block

    def split(self, text: str, finished: bool) -> Split:
        body = text.lstrip()
        if not finished and body and START.startswith(body) and body != START:
            return Split("", "")  # may become the opening tag
        if body.startswith(START):
            body = body[len(START):]
        elif not self.opened_by_prompt:
            return Split("", text)
        end = body.find(END)
        if end >= 0:
            return Split(body[:end].lstrip(), body[end + len(END):].lstrip())
        keep = len(body) if finished else len(body) - held_back(body, END)
        return Split(body[:keep].lstrip(), "")  # stripped on the left only: streamed, it only grows


REASONING_PARSERS = {"qwen3": ReasoningParser("qwen3", False), "deepseek_r1": ReasoningParser("deepseek_r1", True)}


def reasoning_parser(name: str) -> ReasoningParser:
    if name not in REASONING_PARSERS:
        raise ValueError(f"unknown reasoning parser {name!r}; known: {sorted(REASONING_PARSERS)}")
    return REASONING_PARSERS[name]
