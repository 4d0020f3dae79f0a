"""GET /v1/models, /health, /ping, /version, /metrics, /openapi.json; POST /tokenize, /detokenize."""

from __future__ import annotations

import time

from flask import Blueprint, Response, jsonify
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

import jaxllm
from jaxllm.errors import PromptTooLongError
from jaxllm.tokenizer.chat_template import ChatTemplateError
from server.bridge import offload
from server.errors import APIError
from server.openai_routes import state
from server.openapi import openapi_document
from server.parsing import parse
from server.protocol import DetokenizeRequest, TokenizeRequest, message_chars

bp = Blueprint("admin", __name__)
STARTED = int(time.time())
OPENAPI = openapi_document()


@bp.get("/v1/models")
def models():
    """The base model, then each LoRA adapter with `parent` the base's id (vLLM's shape, except `root`: an adapter's
    name, not its path on the server's disk)."""
    st = state()
    card = {"object": "model", "created": STARTED, "owned_by": "jaxllm", "max_model_len": st.frontend.max_model_len}
    return jsonify({"object": "list", "data": [
        {"id": st.model_name, **card, "root": st.model_name, "parent": None},
        *({"id": r.lora_name, **card, "root": r.lora_name, "parent": st.model_name} for r in st.loras)]})


@bp.get("/health")
def health():
    if not state().loop.alive:
        return jsonify({"status": "engine dead"}), 503
    return jsonify({"status": "ok"})


@bp.get("/ping")
def ping():
    return health()


@bp.get("/version")
def version():
    return jsonify({"version": jaxllm.__version__})


@bp.get("/openapi.json")
def openapi():
    return jsonify(OPENAPI)


@bp.get("/metrics")
def metrics():
    return Response(generate_latest(state().metrics.registry), mimetype=CONTENT_TYPE_LATEST)


@bp.post("/tokenize")
def tokenize():
    req = parse(TokenizeRequest)
    st = state()
    tok = st.frontend.tokenizer
    if tok is None:
        raise APIError(400, "this model has no tokenizer", param="prompt")
    frontend = st.frontend

    def token_ids() -> list[int]:
        if req.messages is not None:
            text = tok.apply_chat_template([m.as_template_input() for m in req.messages],
                                           add_generation_prompt=req.add_generation_prompt)
            frontend.check_text_fits(text)
            return tok.encode(text, add_special_tokens=False)
        frontend.check_text_fits(req.prompt)
        return tok.encode(req.prompt, add_special_tokens=req.add_special_tokens)

    try:
        ids = offload(len(req.prompt) if req.prompt is not None else message_chars(req.messages), token_ids)
    except PromptTooLongError as e:
        raise APIError(400, str(e), param="messages" if req.messages is not None else "prompt",
                       code="context_length_exceeded") from None
    except (ChatTemplateError, ValueError) as e:
        raise APIError(400, f"messages: {e}", param="messages") from None
    return jsonify({"tokens": ids, "count": len(ids), "max_model_len": st.frontend.max_model_len})


@bp.post("/detokenize")
def detokenize():
    req = parse(DetokenizeRequest)
    st = state()
    vocab = st.frontend.limits.vocab_size
    if any(not 0 <= t < vocab for t in req.tokens):
        raise APIError(400, f"tokens: token ids must be in [0, {vocab})", param="tokens")
    if st.frontend.tokenizer is None:
        raise APIError(400, "this model has no tokenizer", param="tokens")
    return jsonify({"prompt": st.frontend.tokenizer.decode(req.tokens, skip_special_tokens=False)})
