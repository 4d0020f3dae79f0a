"""Turning a chat choice's text into OpenAI's message fields when tools are in play, whole or as stream deltas.

Modes: "named" (the text is the named function's arguments, constrained), "required" (the text is a constrained
JSON array of calls), "auto" (free text read by the model's tool parser). Streamed deltas and the whole message are
built from the same scans, so the deltas assemble to exactly the non-streamed message.
"""

from __future__ import annotations

import dataclasses
import uuid
from typing import Any

from jaxllm.tools.choice import calls_from_named, calls_from_required
from jaxllm.tools.parsers import Scan, ToolCall, ToolParser


def tool_mode(req) -> str | None:
    if not req.uses_tools():
        return None
    if req.tool_choice == "required":
        return "required"
    return "auto" if req.tool_choice in (None, "auto") else "named"


def _scan(mode: str, req, parser: ToolParser | None, text: str, finished: bool, stopped: bool) -> Scan:
    if mode == "auto":
        return parser.scan(text, finished)
    if not finished:
        return Scan("", [])
    if mode == "named":  # the call is named up front; a cut (length) leaves its arguments incomplete, as streamed
        return Scan("", calls_from_named(req.tool_choice.function.name, text))
    if not stopped:  # a required array cut by max_tokens: no complete call, the text is all there is
        return Scan(text, [])
    return Scan("", calls_from_required(text))


def call_json(call: ToolCall, call_id: str) -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}


def message(mode: str, req, parser: ToolParser | None, text: str, finish_reason: str | None
            ) -> tuple[dict[str, Any], str | None]:
    """The assistant message of a finished choice, and its finish_reason ("tool_calls" when it made calls)."""
    scan = _scan(mode, req, parser, text, True, finish_reason == "stop")
    msg: dict[str, Any] = {"role": "assistant", "content": scan.content or (None if scan.calls else "")}
    if scan.calls:
        msg["tool_calls"] = [call_json(c, c.id) for c in scan.calls]
        return msg, ("tool_calls" if finish_reason == "stop" else finish_reason)
    return msg, finish_reason


@dataclasses.dataclass
class ChoiceStream:
    """What one streamed choice has sent: content characters, and calls (with the ids they were sent under)."""

    mode: str
    req: Any
    parser: ToolParser | None
    content_sent: int = 0
    calls_sent: int = 0
    named_started: bool = False
    named_args_sent: int = 0

    def deltas(self, text: str, finished: bool, stopped: bool) -> tuple[list[dict[str, Any]], bool]:
        """The deltas for the text so far, and whether any of them carried a call."""
        if self.mode == "named":
            return self._named(text)
        scan = _scan(self.mode, self.req, self.parser, text, finished, stopped)
        out = []
        if len(scan.content) > self.content_sent:
            out.append({"content": scan.content[self.content_sent:]})
            self.content_sent = len(scan.content)
        for i, call in enumerate(scan.calls[self.calls_sent:], start=self.calls_sent):
            call_id = f"call_{uuid.uuid4().hex[:24]}"
            out.append({"tool_calls": [{"index": i, "id": call_id, "type": "function",
                                        "function": {"name": call.name, "arguments": ""}}]})
            out.append({"tool_calls": [{"index": i, "function": {"arguments": call.arguments}}]})
        self.calls_sent = len(scan.calls)
        return out, self.calls_sent > 0

    def _named(self, text: str) -> tuple[list[dict[str, Any]], bool]:
        out = []
        if not self.named_started:
            self.named_started = True
            out.append({"tool_calls": [{"index": 0, "id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                                        "function": {"name": self.req.tool_choice.function.name,
                                                     "arguments": ""}}]})
        if len(text) > self.named_args_sent:
            out.append({"tool_calls": [{"index": 0, "function": {"arguments": text[self.named_args_sent:]}}]})
            self.named_args_sent = len(text)
        return out, True
