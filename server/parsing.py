"""Request bodies from bytes to validated pydantic models, every failure a 400 naming the parameter.

Before pydantic sees a body: it must be UTF-8 JSON whose top level is an object, nested at most
MAX_JSON_DEPTH deep (Python's parser would raise RecursionError on a deep enough one), with no lone
surrogates in any string (JSON's \\ud800 escapes produce them; no tokenizer takes them).
"""

from __future__ import annotations

import json
from typing import TypeVar

from flask import current_app, request
from pydantic import BaseModel, ValidationError

from jaxllm.errors import InvalidRequestError
from jaxllm.lora.request import LoRARequest
from server.errors import APIError

MAX_JSON_DEPTH = 32
M = TypeVar("M", bound=BaseModel)


def _check_structure(body: object) -> None:
    stack: list[tuple[object, int, str]] = [(body, 0, "")]
    while stack:
        value, depth, path = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise APIError(400, f"the request body is nested deeper than {MAX_JSON_DEPTH} levels",
                           param=path.split(".")[0] or None)
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                raise APIError(400, f"{path or 'body'}: not valid Unicode (a lone surrogate)",
                               param=path or None) from None
        elif isinstance(value, dict):
            for k, v in value.items():
                sub = f"{path}.{k}" if path else str(k)
                stack.append((k, depth + 1, sub))
                stack.append((v, depth + 1, sub))
        elif isinstance(value, list):
            stack.extend((v, depth + 1, f"{path}.{i}") for i, v in enumerate(value))


def read_json() -> dict:
    raw = request.get_data(cache=False)  # over MAX_CONTENT_LENGTH: werkzeug raises 413
    try:
        body = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise APIError(400, "the request body is not valid UTF-8") from None
    except RecursionError:
        raise APIError(400, f"the request body is nested deeper than {MAX_JSON_DEPTH} levels") from None
    except ValueError as e:  # JSONDecodeError, and integers with more digits than Python converts
        raise APIError(400, f"the request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    _check_structure(body)
    return body


def _field_path(loc: tuple) -> list:
    """The location without pydantic's union-member tags ('str', 'list[ContentPart]', 'constrained-str')."""
    path = []
    for x in loc:
        if isinstance(x, str) and (x in _TAGS or "[" in x or "-" in x or x[:1].isupper()):
            continue
        path.append(x)
    return path


_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}


def parse(model_cls: type[M]) -> M:
    body = read_json()
    try:
        req = model_cls.model_validate(body)
    except ValidationError as e:
        # A union (e.g. content: str | list[part]) reports one error per member: the deepest is the telling one.
        err = max(e.errors(include_url=False), key=lambda x: len(x["loc"]))
        loc = ".".join(str(x) for x in _field_path(err["loc"]))
        msg = err["msg"].removeprefix("Value error, ")
        if not loc and ":" in msg:  # a model-level check: "param: message"
            loc, msg = msg.split(":", 1)
            msg = msg.strip()
        raise APIError(400, f"{loc + ': ' if loc else ''}{msg}", param=loc or None) from None
    st = current_app.extensions["jaxllm"]
    model = getattr(req, "model", None)
    if model not in (None, st.model_name) and st.loras.get(model) is None:
        raise APIError(404, f"the model '{model}' does not exist; this server serves '{st.model_name}'"
                       + (" and LoRA adapters (GET /v1/models)" if len(st.loras) else ""), param="model",
                       code="model_not_found")
    return req


def served_lora(req) -> LoRARequest | None:
    """The adapter a parsed request's ``model`` names (None: the base model)."""
    return current_app.extensions["jaxllm"].loras.get(getattr(req, "model", None))


def invalid(e: InvalidRequestError) -> APIError:
    return APIError(400, str(e), param=e.param)
