"""The Flask app. ``gunicorn server.app:app`` (with ./gunicorn.conf.py: one gevent worker) builds it from
the environment (see server/settings.py); `create_app` builds one from explicit settings."""

from __future__ import annotations

import hmac
import logging
import re
import time
import uuid

from flask import Flask, Response, g, request
from werkzeug.exceptions import HTTPException

from jaxllm.engine.core_client import EngineCoreClient
from jaxllm.engine.dp_client import DataParallelClient
from jaxllm.engine.engine_loop import EngineLoop
from jaxllm.engine.llm_engine import LLMEngine
from jaxllm.environment import Environment
from server import admin_routes, lora_routes, openai_routes, pooling_routes
from server.errors import APIError, error_response
from server.generation import ClientGone
from server.lora_modules import LoRAModuleError, LoRARegistry
from server.metrics import ServerMetrics
from server.settings import ServerSettings
from server.state import ServerState

logger = logging.getLogger("jaxllm.server")
access_log = logging.getLogger("jaxllm.access")
# Open without the API key: probes, metrics and the API's own description. Everything else, in particular every
# route that touches the model (/v1/*, /tokenize, /detokenize), needs it.
OPEN_PATHS = {"/health", "/ping", "/version", "/metrics", "/openapi.json"}
REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")  # a client's X-Request-Id, echoed and logged only if it fits


def create_app(settings: ServerSettings, engine: LLMEngine | None = None) -> Flask:
    """An app on `engine`, or on the engine-core process at `settings.engine_address`, or on an engine it
    starts in this process."""
    if settings.engine_address and engine is None:
        if not settings.engine_secret:
            raise ValueError("JAXLLM_ENGINE_ADDRESS needs JAXLLM_ENGINE_SECRET, the secret shared with the core")
        addresses = [a.strip() for a in settings.engine_address.split(",") if a.strip()]
        logger.info("connecting to the engine core(s) at %s", ", ".join(addresses))
        if len(addresses) == 1:
            loop = EngineCoreClient(addresses[0], settings.engine_secret, timeout_s=settings.startup_timeout_s)
        else:  # one core per data-parallel rank
            loop = DataParallelClient(addresses, settings.engine_secret, timeout_s=settings.startup_timeout_s)
    else:
        if engine is None:
            logger.info("starting the engine: %s", settings.engine)
            engine = LLMEngine(settings.engine)
        loop = EngineLoop(engine)
    frontend = loop.frontend  # tokenizer and limits (with engine cores, the model is in them)
    if settings.chat_template is not None and frontend.tokenizer is not None:
        frontend.tokenizer.set_chat_template(settings.chat_template)  # before any request: one writer
    app = Flask("jaxllm")
    app.config["MAX_CONTENT_LENGTH"] = settings.max_body_bytes
    app.json.sort_keys = False
    st = ServerState(settings=settings, loop=loop, metrics=ServerMetrics(loop, frontend.model_name),
                     loras=_lora_registry(settings, frontend))
    app.extensions["jaxllm"] = st
    app.register_blueprint(openai_routes.bp)
    app.register_blueprint(pooling_routes.bp)
    app.register_blueprint(admin_routes.bp)
    app.register_blueprint(lora_routes.bp)
    if settings.allowed_origins:
        from flask_cors import CORS

        CORS(app, origins=list(settings.allowed_origins), expose_headers=["X-Request-Id"],
             allow_headers=["Authorization", "Content-Type", "X-Request-Id"])

    @app.before_request
    def before():
        given = request.headers.get("X-Request-Id", "")
        g.request_id = given if REQUEST_ID.fullmatch(given) else uuid.uuid4().hex
        g.start = time.monotonic()
        if settings.api_key and request.path not in OPEN_PATHS and request.method != "OPTIONS":
            header = request.headers.get("Authorization", "")
            token = header.removeprefix("Bearer ").strip() if header.startswith("Bearer ") else ""
            if not hmac.compare_digest(token.encode(), settings.api_key.encode()):
                return error_response(401, "invalid or missing API key (Authorization: Bearer <key>)",
                                      code="invalid_api_key")
        return None

    @app.after_request
    def after(resp):
        resp.headers["X-Request-Id"] = g.get("request_id", "")
        if not resp.is_streamed and request.path not in ("/v1/completions", "/v1/chat/completions") or \
                resp.status_code >= 400:
            access_log.info('%s "%s %s" %d request_id=%s latency=%.3fs', request.remote_addr, request.method,
                            request.path, resp.status_code, g.get("request_id"),
                            time.monotonic() - g.get("start", time.monotonic()))
        return resp

    @app.errorhandler(APIError)
    def api_error(e: APIError):
        return e.response()

    @app.errorhandler(ClientGone)
    def client_gone(e: ClientGone):
        return Response(status=499)  # nginx's "client closed request": nobody reads it

    @app.errorhandler(HTTPException)
    def http_error(e: HTTPException):
        messages = {404: f"no route {request.method} {request.path}",
                    405: f"method {request.method} is not allowed on {request.path}",
                    413: f"the request body is larger than {settings.max_body_bytes} bytes"}
        return error_response(e.code or 500, messages.get(e.code, e.description or str(e)))

    @app.errorhandler(Exception)
    def unexpected(e: Exception):
        logger.exception("unhandled error")
        return error_response(500, f"internal error: {type(e).__name__}")

    logger.info("ready: serving %s (max_model_len %d)", frontend.model_name, frontend.max_model_len)
    return app


def _lora_registry(settings: ServerSettings, frontend) -> LoRARegistry:
    """The adapters of JAXLLM_LORA_MODULES, each read and checked now: a bad one stops the server here."""
    registry = LoRARegistry(frontend.model_name, frontend.check_lora, roots=settings.lora_roots,
                            allow_runtime=settings.allow_runtime_lora_updating)
    for module in settings.lora_modules:
        if module.base_model_name not in (None, frontend.model_name):
            raise ValueError(f"LoRA module {module.name!r}: base_model_name {module.base_model_name!r} is not the "
                             f"served model {frontend.model_name!r}")
        try:
            registry.add(registry.prepare(module.name, module.path, runtime=False))
        except LoRAModuleError as e:
            raise ValueError(f"JAXLLM_LORA_MODULES: {e}") from None
        logger.info("serving LoRA adapter %s from %s", module.name, module.path)
    return registry


_app: Flask | None = None


def __getattr__(name: str):
    """``server.app:app`` is built on first access, in the gunicorn worker (never in the master)."""
    global _app
    if name == "app":
        if _app is None:
            root = logging.getLogger("jaxllm")  # engine, server and access logs
            if not root.handlers:
                handler = logging.StreamHandler()
                handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
                root.addHandler(handler)
                root.setLevel(Environment.read().log_level.upper())
                root.propagate = False
            _app = create_app(ServerSettings.from_env())
        return _app
    raise AttributeError(name)
