"""Errors a request can get back from any entry point (Python API, CLI, HTTP), each naming its parameter."""

from __future__ import annotations


class InvalidRequestError(ValueError):
    """A request the engine refuses; `param` names the offending field (HTTP turns it into a 400)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class PromptTooLongError(InvalidRequestError):
    def __init__(self, message: str):
        super().__init__(message, "prompt")


class RequestFailedError(RuntimeError):
    """Handling one request raised (its detokenizer, stop strings or output callback); the others go on."""


class EngineBusyError(RuntimeError):
    """The engine holds as many requests as it may (running batch plus waiting queue); retry later (HTTP 429).
    An engine-core process shared by several API servers says so itself, since no one server sees the others'."""
