"""OpenAI's error shape: {"error": {"message", "type", "param", "code"}} with the matching HTTP status."""

from __future__ import annotations

from flask import Response, jsonify

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
               405: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error",
               500: "server_error", 503: "service_unavailable_error"}


class APIError(Exception):
    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def response(self) -> Response:
        return error_response(self.status, self.message, param=self.param, code=self.code)


def error_response(status: int, message: str, *, param: str | None = None, code: str | None = None) -> Response:
    body = {"error": {"message": message, "type": ERROR_TYPES.get(status, "invalid_request_error"),
                      "param": param, "code": code}}
    resp = jsonify(body)
    resp.status_code = status
    return resp
