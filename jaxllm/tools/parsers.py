"""Extracting tool calls from generated text, for the formats models are trained on.

- ``hermes``: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks (Qwen2.5, Qwen3, Hermes);
- ``llama3_json``: the whole answer is ``{"name": ..., "parameters": {...}}`` objects, ``;``-separated, maybe after
  ``<|python_tag|>`` (Llama 3.1/3.2);
- ``mistral``: ``[TOOL_CALLS]`` then a JSON array of ``{"name", "arguments"}``.

Each parser reads the text generated so far (`scan`): the content that is surely not part of a call, the calls
complete so far, and whether the text is finished. Streaming sends what grows between scans; the final scan is the
non-streamed answer, so streamed deltas assemble to exactly the non-streamed message. A call whose JSON does not
parse leaves the whole text as content (as vLLM does).
"""

from __future__ import annotations

import dataclasses
import json
import re
import uuid


@dataclasses.dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text
    id: str = dataclasses.field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}", compare=False)


@dataclasses.dataclass(frozen=True)
class Scan:
    content: str  # text that is not (and cannot become) part of a call
    calls: list[ToolCall]  # calls complete so far


def _call(obj, args_key: str) -> ToolCall:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        raise ValueError("a tool call needs a string 'name'")
    args = obj.get(args_key, obj.get("arguments", obj.get("parameters", {})))
    return ToolCall(obj["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False))


def held_back(text: str, marker: str) -> int:
    """Length of the longest suffix of text that is a proper prefix of marker (it may yet become the marker)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


class ToolParser:
    name = ""

    def scan(self, text: str, finished: bool) -> Scan:
        raise NotImplementedError


class HermesParser(ToolParser):
    name = "hermes"
    START, END = "<tool_call>", "</tool_call>"

    def scan(self, text: str, finished: bool) -> Scan:
        first = text.find(self.START)
        if first < 0:
            keep = len(text) if finished else len(text) - held_back(text, self.START)
            return Scan(text[:keep], [])
        calls = []
        for block in re.finditer(re.escape(self.START) + r"(.*?)" + re.escape(self.END), text[first:], re.S):
            try:
                calls.append(_call(json.loads(block.group(1)), "arguments"))
            except ValueError:
                return Scan(text if finished else text[:first], [])
        if finished and not calls:
            return Scan(text, [])
        if finished and text[first:].count(self.START) > len(calls):  # an unclosed last block: its JSON may be whole
            tail = text[first:].rsplit(self.START, 1)[1]
            try:
                calls.append(_call(json.loads(tail), "arguments"))
            except ValueError:
                pass
        return Scan(text[:first], calls)


class Llama3JsonParser(ToolParser):
    name = "llama3_json"
    TAG = "<|python_tag|>"

    def scan(self, text: str, finished: bool) -> Scan:
        body = text.lstrip()
        body = body.removeprefix(self.TAG).lstrip()
        if not body or not (body.startswith("{") or self.TAG.startswith(text.lstrip())):
            return Scan(text, [])
        if not finished:
            return Scan("", [])  # a call is being written: it is read whole at the end
        calls, decoder, at = [], json.JSONDecoder(), 0
        try:
            while at < len(body):
                obj, at = decoder.raw_decode(body, at)
                calls.append(_call(obj, "parameters"))
                at = len(body) - len(body[at:].lstrip().removeprefix(";").lstrip())
        except ValueError:
            return Scan(text, [])
        return Scan("", calls)


class MistralParser(ToolParser):
    name = "mistral"
    MARKER = "[TOOL_CALLS]"

    def scan(self, text: str, finished: bool) -> Scan:
        at = text.find(self.MARKER)
        if at < 0:
            keep = len(text) if finished else len(text) - held_back(text, self.MARKER)
            return Scan(text[:keep], [])
        if not finished:
            return Scan(text[:at], [])
        try:
            payload = json.loads(text[at + len(self.MARKER):].strip())
            calls = [_call(obj, "arguments") for obj in (payload if isinstance(payload, list) else [payload])]
        except ValueError:
            return Scan(text, [])
        return Scan(text[:at], calls)


TOOL_PARSERS: dict[str, type[ToolParser]] = {p.name: p for p in (HermesParser, Llama3JsonParser, MistralParser)}


def parser_for_template(template: str | None) -> str:
    """The parser a chat template's own tool format calls for (hermes when it shows none)."""
    template = template or ""
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if "<|python_tag|>" in template or ('"parameters"' in template and "ipython" in template):
        return "llama3_json"
    return "hermes"


def tool_parser(name: str) -> ToolParser:
    if name not in TOOL_PARSERS:
        raise ValueError(f"unknown tool call parser {name!r}; known: {sorted(TOOL_PARSERS)}")
    return TOOL_PARSERS[name]()
