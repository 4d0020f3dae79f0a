"""The server's OpenAPI 3.1 document, generated from the pydantic request models (server/protocol.py) and the
response models below; served at GET /openapi.json. Every status a route can answer is listed, so a client
(or schemathesis) can check each response against it."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict
from pydantic.json_schema import models_json_schema

import jaxllm
from server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    EmbeddingRequest,
    LoadLoRAAdapterRequest,
    RerankRequest,
    ScoreRequest,
    TokenizeRequest,
    UnloadLoRAAdapterRequest,
)


class _Response(BaseModel):
    model_config = ConfigDict(extra="allow")


class ErrorBody(_Response):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(_Response):
    error: ErrorBody


class Usage(_Response):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionChoice(_Response):
    index: int
    text: str
    logprobs: dict[str, Any] | None
    finish_reason: str | None
    stop_reason: int | str | None = None


class Completion(_Response):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class ChatMessageOut(_Response):
    role: Literal["assistant"]
    content: str | None


class ChatChoice(_Response):
    index: int
    message: ChatMessageOut
    logprobs: dict[str, Any] | None
    finish_reason: str | None
    stop_reason: int | str | None = None


class ChatCompletion(_Response):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ModelCard(_Response):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    root: str
    parent: str | None  # a LoRA adapter's base model (None: the base model)
    max_model_len: int


class ModelList(_Response):
    object: Literal["list"]
    data: list[ModelCard]


class TokenizeResponse(_Response):
    tokens: list[int]
    count: int
    max_model_len: int


class DetokenizeResponse(_Response):
    prompt: str


class Embedding(_Response):
    index: int
    object: Literal["embedding"]
    embedding: list[float] | str  # floats, or base64 of little-endian float32 (encoding_format)


class PoolingData(_Response):
    index: int
    object: Literal["pooling"]
    data: list[float] | str


class PoolingUsage(_Response):
    prompt_tokens: int
    total_tokens: int


class EmbeddingList(_Response):
    id: str
    object: Literal["list"]
    created: int
    model: str
    data: list[Embedding]
    usage: PoolingUsage


class PoolingList(EmbeddingList):
    data: list[PoolingData]


class Score(_Response):
    index: int
    object: Literal["score"]
    score: float


class ScoreList(_Response):
    id: str
    object: Literal["list"]
    created: int
    model: str
    data: list[Score]
    usage: PoolingUsage


class RerankedDocument(_Response):
    text: str


class RerankResult(_Response):
    index: int
    document: RerankedDocument | None = None
    relevance_score: float


class RerankUsage(_Response):
    total_tokens: int


class RerankResponse(_Response):
    id: str
    model: str
    usage: RerankUsage
    results: list[RerankResult]


class Health(_Response):
    status: str


class Version(_Response):
    version: str


REQUESTS = [ChatCompletionRequest, CompletionRequest, EmbeddingRequest, ScoreRequest, RerankRequest, TokenizeRequest,
            DetokenizeRequest, LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest]
RESPONSES = [ErrorResponse, Completion, ChatCompletion, EmbeddingList, PoolingList, ScoreList, RerankResponse,
             ModelList, TokenizeResponse, DetokenizeResponse, Health, Version]
ERRORS = {400: "Invalid request", 401: "Missing or wrong API key", 404: "Unknown model", 413: "Body too large",
          429: "Request queue full", 500: "The request failed", 503: "The engine is not running"}


def _ref(model: type[BaseModel]) -> dict:
    return {"$ref": f"#/components/schemas/{model.__name__}"}


def _json(model: type[BaseModel]) -> dict:
    return {"application/json": {"schema": _ref(model)}}


def _errors(*codes: int) -> dict:
    return {str(c): {"description": ERRORS[c], "content": _json(ErrorResponse)} for c in codes}


def _generate(request: type[BaseModel], response: type[BaseModel], summary: str) -> dict:
    return {"post": {
        "summary": summary, "security": [{"bearer": []}],
        "requestBody": {"required": True, "content": _json(request)},
        "responses": {"200": {"description": "The answer; with stream=true, server-sent events ending with "
                                             "'data: [DONE]'",
                              "content": {**_json(response), "text/event-stream": {"schema": SSE_EVENT}}},
                      **_errors(400, 401, 404, 413, 429, 500, 503)}}}


# One server-sent event (on OpenAPI 3.1 a text/event-stream schema describes each event, as 3.2's itemSchema does):
# its data is a JSON chunk, or "[DONE]" at the end.
SSE_EVENT = {"type": "object", "required": ["data"], "properties": {
    "data": {"type": "string", "contentMediaType": "application/json"}, "event": {"type": "string"},
    "id": {"type": "string"}, "retry": {"type": "integer"}}}


def _simple(method: str, response: type[BaseModel] | None, summary: str, *, request: type[BaseModel] | None = None,
            secured: bool = False, errors: tuple[int, ...] = (), content: dict | None = None) -> dict:
    op: dict[str, Any] = {"summary": summary,
                          "responses": {"200": {"description": "OK", "content": content or _json(response)},
                                        **_errors(*errors)}}
    if secured:
        op["security"] = [{"bearer": []}]
        op["responses"].update(_errors(401))
    if request is not None:
        op["requestBody"] = {"required": True, "content": _json(request)}
    return {method: op}


def _health(summary: str) -> dict:
    return {"get": {"summary": summary, "responses": {
        "200": {"description": "OK", "content": _json(Health)},
        "503": {"description": "The engine is not running", "content": _json(Health)}}}}


def openapi_document() -> dict:
    _, schemas = models_json_schema([(m, "validation") for m in REQUESTS + RESPONSES],
                                    ref_template="#/components/schemas/{model}")
    return {
        "openapi": "3.1.0",
        "info": {"title": "jaxllm", "version": jaxllm.__version__,
                 "description": "OpenAI-compatible API of the jaxllm inference engine"},
        "paths": {
            "/v1/chat/completions": _generate(ChatCompletionRequest, ChatCompletion, "Chat completion"),
            "/v1/completions": _generate(CompletionRequest, Completion, "Text completion"),
            "/v1/embeddings": _simple("post", EmbeddingList, "Embeddings (a model that embeds; others answer 400)",
                                      request=EmbeddingRequest, secured=True, errors=(400, 404, 413, 429, 500, 503)),
            "/pooling": _simple("post", PoolingList, "Pooled hidden states (vLLM's /pooling)", request=EmbeddingRequest,
                                secured=True, errors=(400, 404, 413, 429, 500, 503)),
            "/score": _simple("post", ScoreList, "Scores of text pairs (a cross-encoder or an embedding model)",
                              request=ScoreRequest, secured=True, errors=(400, 404, 413, 429, 500, 503)),
            "/rerank": _simple("post", RerankResponse, "Documents ranked by relevance to a query",
                               request=RerankRequest, secured=True, errors=(400, 404, 413, 429, 500, 503)),
            "/v1/rerank": _simple("post", RerankResponse, "Same as /rerank", request=RerankRequest, secured=True,
                                  errors=(400, 404, 413, 429, 500, 503)),
            "/v1/models": _simple("get", ModelList, "The served model and its LoRA adapters", secured=True),
            "/v1/load_lora_adapter": _simple("post", None, "Serve a LoRA adapter under a name (only with "
                                             "JAXLLM_ALLOW_RUNTIME_LORA_UPDATING=true)",
                                             request=LoadLoRAAdapterRequest, secured=True, errors=(400, 413),
                                             content={"text/plain": {"schema": {"type": "string"}}}),
            "/v1/unload_lora_adapter": _simple("post", None, "Stop serving a LoRA adapter (only with "
                                               "JAXLLM_ALLOW_RUNTIME_LORA_UPDATING=true)",
                                               request=UnloadLoRAAdapterRequest, secured=True, errors=(400, 404, 413),
                                               content={"text/plain": {"schema": {"type": "string"}}}),
            "/tokenize": _simple("post", TokenizeResponse, "Token ids of a prompt or chat", request=TokenizeRequest,
                                 secured=True, errors=(400, 404, 413)),
            "/detokenize": _simple("post", DetokenizeResponse, "Text of token ids", request=DetokenizeRequest,
                                   secured=True, errors=(400, 404, 413)),
            "/health": _health("200 while the engine runs, 503 once it died"),
            "/ping": _health("Same as /health"),
            "/version": _simple("get", Version, "jaxllm's version"),
            "/metrics": _simple("get", None, "Prometheus metrics",
                                content={"text/plain": {"schema": {"type": "string"}}}),
        },
        "components": {"schemas": schemas.get("$defs", {}),
                       "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}},
    }
