"""An engine core alone, for API servers that connect to it (headless mode, and the engine process that
gunicorn.conf.py starts for several API workers):

    JAXLLM_ENGINE_SECRET=... python -m server.engine_core [--address tcp://127.0.0.1:5555]

The engine is configured from the same JAXLLM_* variables as the server (server/settings.py). The default
address is loopback; bind another interface only on a network you trust: the shared secret authenticates API
servers (an HMAC challenge; the secret never crosses the wire) but the traffic is not encrypted. SIGTERM stops
it after in-flight requests finish (JAXLLM_DRAIN_TIMEOUT). Exit status: 0 when stopped, 1 when the engine died
(a supervisor restarts it; API servers answer 503 meanwhile and reconnect on their own)."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys

DEFAULT_ADDRESS = "tcp://127.0.0.1:5555"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--address", default=os.environ.get("JAXLLM_ENGINE_BIND", DEFAULT_ADDRESS),
                   help="ZeroMQ address to listen on (tcp://host:port or ipc:///path; default %(default)s)")
    p.add_argument("--headless", action="store_true", help="accepted for vLLM-style command lines (always headless)")
    args = p.parse_args(argv)
    secret = os.environ.get("JAXLLM_ENGINE_SECRET")
    if not secret:
        p.error("set JAXLLM_ENGINE_SECRET: API servers prove they know it")
    logging.basicConfig(level=os.environ.get("JAXLLM_LOG_LEVEL", "info").upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from jaxllm.engine.core_server import EngineCoreServer
    from jaxllm.engine.llm_engine import LLMEngine
    from server.settings import ServerSettings

    settings = ServerSettings.from_env()
    engine = LLMEngine(settings.engine)
    if settings.chat_template is not None and engine.tokenizer is not None:
        engine.tokenizer.set_chat_template(settings.chat_template)
    core = EngineCoreServer(engine, args.address, secret, {"model": settings.engine.model})
    signal.signal(signal.SIGTERM, lambda *_: core.stop(settings.drain_timeout_s))
    signal.signal(signal.SIGINT, lambda *_: core.stop(0.0))
    status = core.serve_forever()
    core.close()
    return status


if __name__ == "__main__":
    sys.exit(main())
