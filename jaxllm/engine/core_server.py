"""An engine core in its own process: the engine loop (`EngineLoop`, the same one an in-process server runs)
behind a ZeroMQ ROUTER socket that API servers connect to (see `core_protocol` for the messages).

Threads: the engine's own thread steps the engine and calls each request's output callback, which encodes the
delta and pushes it through its own inproc socket; this process's main thread owns the ROUTER socket: it
authenticates clients, hands their requests to the loop, forwards outputs to the client that owns them, and
broadcasts the engine's stats every `STATS_INTERVAL_S` (the core's heartbeat). Request ids are namespaced by
client, so one API server can neither see nor abort another's requests. A client that vanished (a killed API
worker) has its requests aborted as soon as an output for it cannot be delivered, so its KV pages come back."""

from __future__ import annotations

import logging
import threading
import time

import zmq

from jaxllm.engine import core_protocol as proto
from jaxllm.engine.engine_loop import EngineDeadError, EngineLoop
from jaxllm.engine.llm_engine import LLMEngine
from jaxllm.errors import InvalidRequestError

logger = logging.getLogger("jaxllm.engine_core")
STATS_INTERVAL_S = 0.2


class EngineCoreServer:
    def __init__(self, engine: LLMEngine, address: str, secret: str, info: dict):
        if not secret:
            raise ValueError("an engine core needs a shared secret (JAXLLM_ENGINE_SECRET)")
        self.engine, self.secret = engine, secret
        self.info = {**info, "model_name": engine.model_name, "max_model_len": engine.max_model_len,
                     "vocab_size": engine.limits.vocab_size, "max_n": engine.limits.max_n,
                     "eos_token_ids": list(engine.eos_token_ids), "max_num_seqs": engine.config.max_num_seqs,
                     "max_waiting_requests": engine.config.max_waiting_requests,
                     "page_size": engine.config.page_size}
        self.loop = EngineLoop(engine)
        self.ctx = zmq.Context.instance()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a send to a vanished client raises: its requests end
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(address)
        self.address = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._outputs_address = f"inproc://jaxllm-core-outputs-{id(self)}"
        self.outputs = self.ctx.socket(zmq.PULL)
        self.outputs.bind(self._outputs_address)
        self._engine_thread = threading.local()
        self.nonces: dict[bytes, bytes] = {}  # client -> the challenge it must answer
        self.clients: set[bytes] = set()  # authenticated
        self.owned: dict[bytes, set[str]] = {}  # client -> its unfinished request ids (core-side, namespaced)
        self._stopping = False
        self._stop_at: float | None = None

    # -- on the engine thread
    def _push(self, client: bytes, payload: bytes) -> None:
        sock = getattr(self._engine_thread, "sock", None)
        if sock is None:
            sock = self._engine_thread.sock = self.ctx.socket(zmq.PUSH)
            sock.connect(self._outputs_address)
        sock.send_multipart([client, payload])

    def _callback(self, client: bytes, request_id: str, core_id: str):
        deltas = proto.OutputDeltas()

        def on_output(out):
            if isinstance(out, EngineDeadError):
                self._push(client, proto.encode("fail", request_id, "dead", str(out), core_id))
            elif isinstance(out, Exception):
                kind = "invalid" if isinstance(out, InvalidRequestError) else "error"
                self._push(client, proto.encode("fail", request_id, kind, str(out), core_id))
            else:
                self._push(client, proto.encode("out", request_id, deltas.delta(out), core_id if out.finished
                                                else None))
        return on_output

    # -- on the main thread
    def serve_forever(self) -> int:
        """Returns the process's exit status: 0 when stopped, 1 when the engine died."""
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        poller.register(self.outputs, zmq.POLLIN)
        last_stats = 0.0
        logger.info("engine core ready on %s", self.address)
        while not self._stopping:
            events = dict(poller.poll(timeout=int(STATS_INTERVAL_S * 1000)))
            if self.outputs in events:
                self._forward_outputs()
            if self.sock in events:
                self._receive()
            now = time.monotonic()
            if now - last_stats >= STATS_INTERVAL_S:
                last_stats = now
                self._broadcast(proto.encode("stats", self.loop.stats))
            if not self.loop.alive and not self._stopping:
                self._forward_outputs()  # the requests' "dead" failures
                logger.error("the engine died; the engine core exits")
                return 1
            if self._stop_at is not None and (now >= self._stop_at or not self.loop.stats.get("num_requests")):
                self.loop.stop(0.0)  # what is still running is aborted
                self._forward_outputs()
                self._stopping = True
        return 0

    def stop(self, drain_timeout_s: float = 0.0) -> None:
        """Asks `serve_forever` to return once in-flight requests finished, or after drain_timeout_s; new
        requests are refused meanwhile. Safe from a signal handler."""
        self._stop_at = time.monotonic() + drain_timeout_s

    def close(self) -> None:
        self.sock.close(0)
        self.outputs.close(0)

    def _send(self, client: bytes, payload: bytes) -> bool:
        try:
            self.sock.send_multipart([client, payload], flags=zmq.NOBLOCK)
            return True
        except zmq.ZMQError as e:  # EHOSTUNREACH: the client is gone; EAGAIN: it stopped reading
            logger.warning("client %s unreachable (%s): aborting its requests", client.hex(), e)
            self._drop(client)
            return False

    def _drop(self, client: bytes) -> None:
        self.clients.discard(client)
        self.nonces.pop(client, None)
        for core_id in self.owned.pop(client, set()):
            self.loop.abort_request(core_id)

    def _broadcast(self, payload: bytes) -> None:
        for client in list(self.clients):
            self._send(client, payload)

    def _forward_outputs(self) -> None:
        while True:
            try:
                client, payload = self.outputs.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            if client not in self.clients:
                continue  # dropped already: its requests are being aborted
            message = proto.decode(payload)
            done = message[-1]  # the core-side id of a request that just ended, else None
            if done is not None:
                self.owned.get(client, set()).discard(done)
            self._send(client, proto.encode(*message[:-1]))

    def _receive(self) -> None:
        while True:
            try:
                client, payload = self.sock.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                message = proto.decode(payload)
                self._handle(client, message)
            except Exception as e:  # a malformed message: refuse it, never die of it
                logger.warning("bad message from client %s: %s", client.hex(), e)

    def _handle(self, client: bytes, message: list) -> None:
        kind = message[0]
        if kind == "hello":  # a repeated hello gets the same challenge (each socket has its own identity)
            if client not in self.clients:
                nonce = self.nonces.setdefault(client, proto.new_nonce())
                self._send(client, proto.encode("challenge", nonce))
        elif kind == "auth":
            if client in self.clients:
                return
            nonce = self.nonces.pop(client, None)
            if nonce is not None and proto.verify(self.secret, nonce, message[1]):
                self.clients.add(client)
                self.owned.setdefault(client, set())
                self._send(client, proto.encode("ready", {**self.info, "stats": self.loop.stats}))
                logger.info("client %s connected", client.hex())
            else:
                logger.warning("client %s refused: wrong secret", client.hex())
                self._send(client, proto.encode("refused", "wrong shared secret"))
        elif client not in self.clients:
            return  # nothing but a handshake from a client that has not passed one
        elif kind == "add":
            _, request_id, text, ids, params, cache_salt = message
            core_id = f"{client.hex()}:{request_id}"
            on_output = self._callback(client, request_id, core_id)
            try:
                if self._stop_at is not None:
                    raise EngineDeadError("the engine core is shutting down")
                params = proto.params_from_wire(params)
                prompt = (text, self.engine.prepare_prompt(list(ids), params, cache_salt)[1])
                self.loop.add_request(core_id, None, params, on_output, cache_salt, prepared=prompt)
            except Exception as e:  # the API side validated it already; refuse what still does not pass
                kind = "invalid" if isinstance(e, InvalidRequestError | ValueError | TypeError) else \
                    "dead" if isinstance(e, EngineDeadError) else "error"
                self._send(client, proto.encode("fail", request_id, kind, str(e)))
                return
            self.owned[client].add(core_id)
        elif kind == "abort":
            core_id = f"{client.hex()}:{message[1]}"
            if core_id in self.owned.get(client, ()):
                self.loop.abort_request(core_id)
