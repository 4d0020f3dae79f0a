"""POST /v1/embeddings (OpenAI's shape) and POST /pooling (vLLM's): one pooled vector per input, from a model that
embeds (``pooling=...`` or a sentence-transformers folder); POST /score (vLLM's), /rerank and /v1/rerank (Jina's and
Cohere's): text pairs scored by a cross-encoder or by the cosine of an embedding model's vectors. A model that
cannot do what a route asks answers 400 saying so."""

from __future__ import annotations

import base64
import logging
import time

import numpy as np
from flask import Blueprint, current_app, g, jsonify, request

from jaxllm import scoring
from jaxllm.errors import InvalidRequestError, PromptTooLongError
from jaxllm.outputs import PoolingRequestOutput
from jaxllm.pooling_params import EMBED, PoolingParams
from server.bridge import offload
from server.errors import APIError
from server.openai_routes import start
from server.parsing import invalid, parse, served_lora
from server.protocol import EmbeddingRequest, RerankRequest, ScoreRequest
from server.state import ServerState

bp = Blueprint("pooling", __name__)
access_log = logging.getLogger("jaxllm.access")


def state() -> ServerState:
    return current_app.extensions["jaxllm"]


def pool(inputs: list[str | list[int]], params: PoolingParams, cache_salt: str | None,
         param: str = "input") -> list[PoolingRequestOutput]:
    """Validates and tokenizes the inputs (off the hub thread), pools them on the engine, waits for every vector."""
    st = state()
    if params.task not in st.frontend.limits.tasks:
        what, hint = ("produce embeddings", "serve an embedding model, or set pooling") if params.task == EMBED else \
            ("classify", "serve a cross-encoder")
        raise APIError(400, f"the model '{st.model_name}' does not {what} (it supports: "
                       f"{', '.join(st.frontend.limits.tasks)}); {hint}", param="model")
    gen = start(inputs, params, cache_salt, prompt_param=param)  # validated and tokenized as prompts are
    outs = gen.wait()
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outs)
    access_log.info('%s "%s %s" 200 request_id=%s prompt_tokens=%d latency=%.3fs', request.remote_addr,
                    request.method, request.path, g.request_id, prompt_tokens, time.monotonic() - gen.start)
    return outs


def _parse(model_cls):
    """`parse`, and a LoRA adapter's name refused: adapters serve generation."""
    req = parse(model_cls)
    if served_lora(req) is not None:
        raise APIError(400, f"the LoRA adapter '{req.model}' serves generation only; name the base model "
                       f"'{state().model_name}'", param="model")
    return req


def _encode(vector: np.ndarray, encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":  # little-endian float32, as OpenAI's client decodes it
        return base64.b64encode(np.asarray(vector, "<f4").tobytes()).decode("ascii")
    return vector.tolist()


def _respond(req: EmbeddingRequest, obj: str, id_prefix: str):
    outs = pool(req.inputs(), req.pooling_params(), req.cache_salt)
    tokens = sum(len(o.prompt_token_ids) for o in outs)
    key = "embedding" if obj == "embedding" else "data"
    data = [{"index": i, "object": obj, key: _encode(o.outputs.data, req.encoding_format)}
            for i, o in enumerate(outs)]
    return jsonify({"id": f"{id_prefix}-{g.request_id}", "object": "list", "created": int(time.time()),
                    "model": state().model_name, "data": data,
                    "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})


@bp.post("/v1/embeddings")
def embeddings():
    return _respond(_parse(EmbeddingRequest), "embedding", "embd")


@bp.post("/pooling")
def pooling():
    return _respond(_parse(EmbeddingRequest), "pooling", "pool")


def _scores(text_1, text_2, truncate: int | None, names: tuple[str, str]) -> tuple[list[float], int]:
    """Scores of the pairs, and the input tokens it took."""
    st = state()
    try:
        pairs = scoring.pairs(text_1, text_2, names)
        for text in dict.fromkeys(t for pair in pairs for t in pair):
            st.frontend.check_text_fits(text)
        chars = sum(len(a) + len(b) for a, b in pairs)
        plan = offload(chars, scoring.plan, st.frontend.limits.tasks, st.frontend.tokenizer, pairs, truncate,
                       st.frontend.score_template)
    except PromptTooLongError as e:
        raise APIError(400, str(e), param=names[1], code="context_length_exceeded") from None
    except InvalidRequestError as e:
        raise invalid(e) from None
    outs = pool(plan.prompts, plan.params, None, param=names[1])
    return plan.combine(outs), sum(len(o.prompt_token_ids) for o in outs)


@bp.post("/score")
def score():
    req = _parse(ScoreRequest)
    scores, tokens = _scores(req.text_1, req.text_2, req.truncate_prompt_tokens, ("text_1", "text_2"))
    return jsonify({"id": f"score-{g.request_id}", "object": "list", "created": int(time.time()),
                    "model": state().model_name,
                    "data": [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)],
                    "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})


@bp.post("/rerank")
@bp.post("/v1/rerank")
def rerank():
    req = _parse(RerankRequest)
    documents = req.texts()
    scores, tokens = _scores(req.query, documents, req.truncate_prompt_tokens, ("query", "documents"))
    results = [{"index": i, **({"document": {"text": documents[i]}} if req.return_documents else {}),
                "relevance_score": s} for i, s in scoring.ranked(scores, req.top_n)]
    return jsonify({"id": f"rerank-{g.request_id}", "model": state().model_name, "usage": {"total_tokens": tokens},
                    "results": results})
