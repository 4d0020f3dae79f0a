"""`tool_choice` "required" or a named function: a JSON-schema constraint that makes even a small model write a
valid call, and the calls read back from what it wrote.

- named: the answer is the function's arguments object (its `parameters` schema);
- required: the answer is ``[{"name": ..., "parameters": {...}}, ...]`` (one item unless parallel calls are
  allowed), each item one of the tools with its own parameters schema.
"""

from __future__ import annotations

import json
from typing import Any

from jaxllm.tools.parsers import ToolCall

ANY_OBJECT = {"type": "object"}


def named_schema(parameters: dict[str, Any] | None) -> dict[str, Any]:
    return parameters or ANY_OBJECT


def required_schema(tools: list[tuple[str, dict[str, Any] | None]], parallel: bool) -> dict[str, Any]:
    items = [{"type": "object", "properties": {"name": {"const": name}, "parameters": named_schema(params)},
              "required": ["name", "parameters"], "additionalProperties": False} for name, params in tools]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def calls_from_named(name: str, text: str) -> list[ToolCall]:
    return [ToolCall(name, text)]


def calls_from_required(text: str) -> list[ToolCall]:
    """The calls of a complete `required` answer (the grammar guarantees its shape)."""
    return [ToolCall(item["name"], json.dumps(item["parameters"], ensure_ascii=False)) for item in json.loads(text)]
