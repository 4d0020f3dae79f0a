"""Chat templates rendered in a sandboxed jinja2 environment, as transformers renders them.

``ImmutableSandboxedEnvironment`` blocks attribute access to Python internals (``__class__``,
``__globals__``...) and mutation of the objects passed in, so a template from an untrusted checkpoint cannot
reach the host process.
"""

from __future__ import annotations

import datetime
import json
from typing import Any

import jinja2.ext
from jinja2.exceptions import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment


class ChatTemplateError(ValueError):
    pass


def _raise_exception(message: str):
    raise ChatTemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None,
            sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


class ChatTemplate:
    def __init__(self, source: str, *, bos_token: str = "", eos_token: str = ""):
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=[jinja2.ext.loopcontrols])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        try:
            self._template = env.from_string(source)
        except TemplateError as e:
            raise ChatTemplateError(f"invalid chat template: {e}") from None
        self.source = source
        self.bos_token, self.eos_token = bos_token, eos_token

    def render(self, messages: list[dict[str, Any]], *, add_generation_prompt: bool = True, **kwargs: Any) -> str:
        try:
            return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                         bos_token=self.bos_token, eos_token=self.eos_token, **kwargs)
        except ChatTemplateError:
            raise
        except TemplateError as e:  # includes SecurityError from the sandbox
            raise ChatTemplateError(f"chat template failed: {e}") from None
        except (TypeError, ValueError, ArithmeticError, LookupError, RecursionError) as e:
            # A template doing arithmetic or lookups on what a client sent (chat_template_kwargs, content).
            raise ChatTemplateError(f"chat template failed: {type(e).__name__}: {e}") from None
